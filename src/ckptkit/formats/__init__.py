"""Checkpoint formats, each behind one interface (``spec.CheckpointFormat``), listed in ``registry``.

Everything here but each format's ``torch.py`` is torch-free: it never imports torch, directly or
through another module, so ``ckptkit convert`` and ``inspect`` run at copy speed and start in
milliseconds (``tests/test_architecture.py`` imports each module in a fresh interpreter to hold
that). One model of a checkpoint: every source opens as its object tree with ``entry.Entry`` tensors
(dtype, shape, where the bytes are and the CRC-32 they must have), selection and renaming act on
that tree, and each output format has one writer that takes it: ``safetensors.write_safetensors``,
``torchzip.writer.write_torch_zip``, ``hf.write.write_shards``, ``dcp.write.write_dcp_entries``.

One package per format, each holding its torch-free codec and, where the format needs torch, its
torch half (``torch.py``, the only modules here that import torch):

- ``entry``: the model; ``detect``: the walk over each format's ``Signature`` (its package's
  ``detect.py``); ``dtypes``: the one dtype table;
- ``torchzip/``: torch's zip: ``container`` (read), ``writer`` (its one writer), ``directory``
  (read by miniz's rules), ``bounds`` (declared sizes against real bytes), ``modulepickle`` and
  ``moduletree`` (a whole pickled module read as its state dict), ``torch`` (torch's pickling);
- ``pickles/``: pickles as torch zips, DCP and DeepSpeed hold them: ``reader`` (inert
  stand-ins), ``globals`` (what they name and model), ``scan`` (what a pickle would import),
  ``dump`` (pickles written from stand-ins);
- ``safetensors/``: ``codec`` (the format and its one writer), ``torch`` (torch tensors);
- ``dcp/``: torch.distributed.checkpoint: its metadata's globals (the package), ``meta`` (the
  metadata read through stand-ins), ``stream`` (a folder's tensors as entries: chunk byte ranges);
- ``hf/``: Hugging Face shards: ``index``, ``write``, ``folders`` (a Trainer ``checkpoint-N/``,
  an Accelerate ``save_state`` folder, a ``save_pretrained`` folder), ``torch`` (shards from
  torch tensors);
- ``deepspeed/``: DeepSpeed ZeRO folders: ``files`` (layout, tag, rank files), ``rebuild``
  (``zero_to_fp32``'s rules as byte ranges), ``stream`` (the rebuilt fp32 state dict as entries);
- across formats: ``producers`` (which framework wrote a checkpoint), ``source`` (a file, or a
  folder of shards, opened as a tree of entries), ``integrity`` (is it intact; a writer's check
  before it publishes), ``cast`` (``convert --dtype`` while copying).

Files themselves (atomic writes, the checked copy, CRC-32) are ``ckptkit.io``, below this.
"""
