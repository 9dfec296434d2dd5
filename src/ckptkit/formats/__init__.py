"""Checkpoint formats, read and written without torch.

Everything in this package is torch-free: it never imports torch, directly or through another
module, so ``ckptkit convert`` and ``inspect`` run at copy speed and start in milliseconds
(``tests/test_architecture.py`` imports each module in a fresh interpreter to hold that).
Modules:

- ``detect``: which format a path holds; ``dtypes``: the one dtype table;
- ``torchzip``/``zipcheck``: torch's zip container, read and written (``zipcheck``: its
  directory, read by miniz's rules); ``torchpickle``: torch's pickles read through inert
  stand-ins, ``torchdump``: written from them; ``bounds``: declared sizes against real bytes;
- ``safetensors``: the safetensors codec; ``dcp``: torch.distributed.checkpoint metadata;
- ``scan``: which globals a pickle would import, without importing them;
- ``rewrite``: renaming a checkpoint's keys by copying its bytes; ``fileio``/``atomic``: bounded
  reads, checked copies, CRC-32 and atomic durable writes; ``kcopy``: the kernel's copies
  (``copy_file_range``, or ``splice`` through a pipe); ``pages``: where a long copy lands within
  a page.
"""
