"""Training state beyond the weights: every RNG (``rng``), the sampler's epoch and position
(``sampler``), and the training-state dict that ``save_training_state`` writes (``state``)."""
