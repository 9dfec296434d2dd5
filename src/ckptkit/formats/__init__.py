"""Checkpoint formats, read and written without torch.

Everything in this package is torch-free: it never imports torch, directly or through another
module, so ``ckptkit convert`` and ``inspect`` run at copy speed and start in milliseconds
(``tests/test_architecture.py`` imports each module in a fresh interpreter to hold that).
Modules, by format:

- ``detect``: which format a path holds; ``dtypes``: the one dtype table;
- torch's zip: ``torchzip`` (the container, read), ``zipwrite`` (written), ``zipcheck`` (its
  directory, read by miniz's rules), ``torchpickle`` (its pickles read through inert
  stand-ins), ``pickleglobals`` (the globals they name, and which the stand-ins model),
  ``torchdump`` (pickles written from stand-ins), ``modulepickle`` (a whole pickled module read
  as its state dict), ``bounds`` (declared sizes against real bytes), ``scan`` (the globals a
  pickle would import);
- ``safetensors``: the safetensors codec;
- ``dcp/``: torch.distributed.checkpoint: its metadata's globals (the package), ``meta`` (the
  metadata read through stand-ins), ``stream`` (a folder's tensors as chunk byte ranges),
  ``write`` (those copied into a torch zip or safetensors);
- ``hf/``: Hugging Face shards: ``index``, ``write``;
- across formats: ``source`` (a file opened as its tensors' byte ranges), ``rewrite`` (renaming a
  checkpoint's keys by copying its bytes), ``integrity`` (is it intact; a writer's check before
  it publishes).

Files themselves (atomic writes, the checked copy, CRC-32) are ``ckptkit.io``, below this.
"""
