"""Checkpoint formats, read and written without torch.

Everything in this package is torch-free: it never imports torch, directly or through another
module, so ``ckptkit convert`` and ``inspect`` run at copy speed and start in milliseconds
(``tests/test_architecture.py`` imports each module in a fresh interpreter to hold that).
One model of a checkpoint: every source opens as its object tree with ``entry.Entry`` tensors
(dtype, shape, where the bytes are and the CRC-32 they must have), selection and renaming act on
that tree, and each output format has one writer that takes it: ``safetensors.write_safetensors``,
``zipwrite.write_torch_zip``, ``hf.write.write_shards`` (DCP output is DCP's own writer).

Modules, by format:

- ``entry``: the model; ``detect``: which format a path holds; ``dtypes``: the one dtype table;
- torch's zip: ``torchzip`` (the container, read), ``zipwrite`` (its one writer), ``zipcheck`` (its
  directory, read by miniz's rules), ``torchpickle`` (its pickles read through inert
  stand-ins), ``pickleglobals`` (the globals they name, and which the stand-ins model),
  ``torchdump`` (pickles written from stand-ins), ``modulepickle`` (a whole pickled module read
  as its state dict), ``moduletree`` (that module's records, and the ``state_dict()`` walk over
  them), ``bounds`` (declared sizes against real bytes), ``scan`` (the globals a pickle would
  import);
- ``safetensors``: the safetensors codec and its one writer;
- ``dcp/``: torch.distributed.checkpoint: its metadata's globals (the package), ``meta`` (the
  metadata read through stand-ins), ``stream`` (a folder's tensors as entries: chunk byte ranges);
- ``hf/``: Hugging Face shards: ``index``, ``write``, and ``folders`` (a Trainer ``checkpoint-N/``,
  an Accelerate ``save_state`` folder, a ``save_pretrained`` folder: what each file holds);
- ``producers``: which framework wrote a checkpoint (timm, mmengine, Lightning, ignite,
  ``AveragedModel``, DeepSpeed), from its entries' names: where its weights and EMA copy are;
- ``deepspeed/``: DeepSpeed ZeRO folders: ``files`` (layout, tag, rank files, pickles read
  through inert stand-ins, refusal of a ZeRO-3 rank file alone), ``rebuild`` (``zero_to_fp32``'s
  rules as byte ranges of the partition records; buffer upcast), ``stream`` (the rebuilt fp32
  state dict as entries, each record's CRC-32 checked from its copied pieces);
- across formats: ``source`` (a file, or a folder of shards, opened as a tree of entries),
  ``integrity`` (is it intact; a writer's check before it publishes), ``cast`` (entries whose
  floating bytes are cast to another dtype as they are copied: ``convert --dtype``).

Files themselves (atomic writes, the checked copy, CRC-32) are ``ckptkit.io``, below this.
"""
