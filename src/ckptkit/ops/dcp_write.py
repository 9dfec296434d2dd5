"""Write a state dict as a torch.distributed.checkpoint (DCP) folder, atomically.

DCP's own writer (``FileSystemWriter``, one process, no process group) writes into a temp
folder beside the destination, which appears whole or not at all (:func:`.io.atomicdir.atomic_folder`).
The object comes from ckptkit's safe readers: nothing was unpickled that the caller did not admit
(torch's ``format_utils.torch_to_dcp`` would ``torch.load`` the source with ``weights_only=False``).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, CheckpointWriteError, CkptkitError, spell
from ..io.atomicdir import atomic_folder
from .dcp_read import first_failure


def write_dcp(obj: Any, path: str | os.PathLike[str]) -> int:
    """Save ``obj`` (a mapping: tensors, nested containers, plain values) as a DCP folder at ``path``.

    Returns the bytes written. ``torch.distributed.checkpoint.load`` reads it into a plain model
    or a sharded one (FSDP2, any world size).

    Raises:
        ArgumentError: ``obj`` is not something DCP can save (not a mapping, or keys it cannot
            flatten); CheckpointWriteError: the folder could not be written.

    Example:
        >>> write_dcp({"fc.weight": torch.ones(2, 2)}, "out.dcp")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    dest = Path(path)
    if not isinstance(obj, Mapping):
        raise ArgumentError(f"{dest}: a DCP folder holds a state dict (a mapping), not a {type(obj).__name__}")
    with atomic_folder(dest) as tmp:  # replaces a folder there: the caller checked it may
        try:
            with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": meant
                warnings.simplefilter("ignore")
                _save_alone(dict(obj), dcp.FileSystemWriter(str(tmp), sync_files=True))
        except CkptkitError:
            raise
        except OSError as e:
            raise CheckpointWriteError(f"cannot write {dest}: {e.strerror or e}") from e
        except (CheckpointException, ValueError, TypeError, AttributeError, RuntimeError, KeyError) as e:
            cause = (first_failure(e) or e) if isinstance(e, CheckpointException) else e  # DCP wraps each rank's
            raise ArgumentError(
                f"{dest}: torch.distributed.checkpoint cannot save this checkpoint ({type(cause).__name__}: {_first_line(cause)}); "
                f"{spell('model_only=True', '--model-only')} writes the weights alone"
            ) from e
        return sum(p.stat().st_size for p in tmp.iterdir())


def _save_alone(state: dict[str, Any], writer: Any) -> None:
    """``dcp.save`` in this process alone, even inside a process group (``no_dist=True``).

    torch 2.6's ``dcp.save`` has no ``no_dist`` (it infers it from whether a group exists);
    its ``_save_state_dict``, which ``dcp.save`` calls, takes it (as ``_dcpread`` uses ``_load_state_dict``).
    """
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.save).parameters:
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

        _save_state_dict(state, storage_writer=writer, no_dist=True)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
