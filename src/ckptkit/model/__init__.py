"""A checkpoint's weights against a model: where they sit in a checkpoint (``layout``), which
wrapper prefixes their keys carry (``wrappers``), the plain model inside its wrappers
(``unwrap``), and a state dict fitted to a model of any wrapping (``fit``)."""
