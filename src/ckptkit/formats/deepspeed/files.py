"""A ZeRO folder's files and pickles: the tag, the rank files in rank order, each pickle read
through inert stand-ins, and the refusal of a ZeRO-3 rank file given alone.

Example:
    >>> natural_key("zero_pp_rank_10_mp_rank_00_model_states.pt")[1]
    10
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ArgumentError, CheckpointFormatError, PartialCheckpointError, UnsupportedCheckpointError, spell
from ..pickles import reader as tp
from ..pickles.globals import DEEPSPEED_GLOBALS, TENSOR_BUILDERS, python3_name
from ..torchzip.container import TorchZip
from ..torchzip.detect import ZIP
from .detect import DEEPSPEED, deepspeed_tag_folder

RANK_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MP_RANK = re.compile(r"mp_rank_(\d+)")


def natural_key(name: str) -> list[Any]:
    """zero_to_fp32's sort key for the rank files: digits compare as numbers (rank 10 after 9)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass
class Layout:
    """Where a ZeRO checkpoint's files are: ``root`` as given, the ``tag`` and its ``folder``, the
    model-state files (one under stage 1/2, one per rank under 3) and one optim file per rank."""

    root: Path
    tag: str
    folder: Path
    model_files: list[Path]
    optim_files: list[Path]


def find_layout(path: Path) -> Layout:
    """The layout of the ZeRO checkpoint at ``path`` (the folder holding ``latest``, or a tag folder).

    Raises:
        CheckpointFormatError: no model-state or optim files; UnsupportedCheckpointError: model
            (tensor or pipeline) parallel ranks beyond ``mp_rank_00``.
    """
    folder = deepspeed_tag_folder(path)
    if folder is None:
        raise CheckpointFormatError(
            f"{path}: not a DeepSpeed checkpoint folder (no latest file, no *_model_states.pt files)"
        )
    models = sorted(folder.glob("*_model_states.pt"), key=lambda p: natural_key(p.name))
    optims = sorted(folder.glob("*_optim_states.pt"), key=lambda p: natural_key(p.name))
    if not optims:
        raise CheckpointFormatError(
            f"{folder}: holds no *_optim_states.pt files, so it has no fp32 weights (saved with "
            "save_checkpoint(..., exclude_frozen_parameters) or without the optimizer?); "
            f"its 16-bit weights are in {models[0].name}: give that file instead"
        )
    mp = sorted({m.group(1) for p in [*models, *optims] if (m := _MP_RANK.search(p.name))})
    if mp not in ([], ["00"]):
        raise UnsupportedCheckpointError(
            f"{folder}: has model-parallel ranks mp_rank_{', mp_rank_'.join(mp)}; ckptkit reads data-parallel "
            "ZeRO checkpoints (mp_rank_00 only). Convert it with DeepSpeed's ds_to_universal.py first"
        )
    return Layout(path, folder.name, folder, models, optims)


class _FromType(tp.Global):
    """``torch._tensor._rebuild_from_type_v2(func, type, args, state)``, how torch pickles a tensor
    with Python attributes (ZeRO-3's fp32 partitions carry ``ds_id``): stands for the tensor
    ``func(*args)`` builds; the attributes are dropped."""

    def __call__(self, *args: Any) -> Any:
        func = args[0] if len(args) == 4 else None
        if (
            isinstance(func, tp.Global)
            and func.module == "torch._utils"
            and func.name in TENSOR_BUILDERS
            and isinstance(args[2], tuple)
        ):
            return func(*args[2])
        return tp.Call(self, args)


class _Unpickler(tp._Unpickler):
    """torchpickle's unpickler, admitting :data:`DEEPSPEED_GLOBALS` as inert records too."""

    dispatch = dict(tp._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except tp.UnsupportedGlobal:
            full = python3_name(module, name, self.proto)
            if full not in DEEPSPEED_GLOBALS:
                raise
            kind = _FromType if full[1] == "_rebuild_from_type_v2" else tp.Global
            return self._globals.setdefault(full, kind(*full))

    def _newobj(self) -> None:
        # NEWOBJ is ``cls.__new__(cls, *args)``: LossScaler and fragment_address are built so. The
        # stand-in records it as a call, and BUILD then records the state as for a REDUCE.
        args, cls = self.stack.pop(), self.stack.pop()
        if not isinstance(cls, tp.Global):
            raise pickle.UnpicklingError(f"NEWOBJ of {type(cls).__name__}, not a class")
        self.append(cls(*args))

    # typeshed types pickle._Unpickler.dispatch's handlers as taking the C pickle.Unpickler; they take _Unpickler
    dispatch[pickle.NEWOBJ[0]] = _newobj  # type: ignore[assignment]


def read_pickle(z: TorchZip) -> Any:
    """A DeepSpeed ``.pt`` file's pickle through inert stand-ins (nothing imported or run).

    Raises:
        UnsupportedCheckpointError: a global beyond torch's tensors and DeepSpeed's own records.
        CheckpointFormatError: a damaged pickle, named by its file.
    """
    try:
        return tp.loads(z.read(f"{z.prefix}data.pkl"), unpickler=_Unpickler)
    except tp.UnsupportedGlobal as e:
        raise UnsupportedCheckpointError(
            f"{z.path}: its pickle names {e.name}, which ckptkit's DeepSpeed reader does not model (it reads "
            "tensors, containers and DeepSpeed's loss scaler, stage and fragment records, nothing run); "
            "rebuild the weights with DeepSpeed's zero_to_fp32.py instead"
        ) from None
    except CheckpointFormatError as e:
        raise CheckpointFormatError(str(e) if str(z.path) in str(e) else f"{z.path}: {e}") from None


def entry_of(obj: Any, key: str, path: Path) -> Any:
    """``obj[key]`` of a DeepSpeed pickle, or an error naming the file and what it holds instead."""
    if not isinstance(obj, Mapping) or key not in obj:
        found = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointFormatError(
            f"{path}: expected a DeepSpeed checkpoint entry {key!r}, found {found or 'nothing'}"
        )
    return obj[key]


def refuse_rank_file(path: Path) -> None:
    """Raise where ``path`` is one rank's model-state file of a ZeRO-3 checkpoint, given alone.

    Such a file is an intact torch zip whose parameters are all 0-element placeholders: read as
    it is, it would give a state dict of empty tensors. It is recognised by what it holds (its
    name matching ``zero_pp_rank_*_model_states.pt``, ``param_shapes`` present, every
    parameter in ``module`` empty), so other files pay only the name check.

    Raises:
        PartialCheckpointError: naming the folder to give instead.

    Example:
        >>> refuse_rank_file(Path("model.pt"))  # not a rank file's name: nothing read
    """
    match = RANK_MODEL_FILE.fullmatch(path.name)
    if match is None or not path.is_file():
        return
    try:
        with TorchZip(path) as z:
            obj = read_pickle(z)
    except CheckpointFormatError:
        return  # not what it is named: the caller's reader says what it is
    if not isinstance(obj, Mapping) or "param_shapes" not in obj or not isinstance(obj.get("module"), Mapping):
        return
    buffers = set(obj.get("buffer_names") or ())
    params = [tp.tensor_of(v) for k, v in obj["module"].items() if k not in buffers]
    if not params or any(t is None or t.numel != 0 for t in params):
        return
    folder = path.parent
    latest = folder.parent / "latest"
    if latest.is_file() and latest.read_text(encoding="utf-8", errors="replace").strip() == folder.name:
        folder = folder.parent
    raise PartialCheckpointError(
        f"{path}: is only rank {int(match.group(1))}'s model-state file of a DeepSpeed ZeRO-3 checkpoint: its "
        f"{len(params)} parameters are 0-element placeholders (expected full tensors, found shape [0]); the "
        f"weights are partitioned across every rank's *_optim_states.pt. Give the checkpoint folder instead: {folder}"
    )


def check_zero_source(path: Path, fmt: str, zero_weights: str) -> None:
    """Refuse ``zero_weights`` other than ``"fp32"`` for a source that is not a ZeRO folder, and a
    ZeRO-3 rank's file given alone (:func:`refuse_rank_file`).

    Raises:
        ArgumentError, PartialCheckpointError.

    Example:
        >>> check_zero_source(Path("model.safetensors"), "safetensors", "fp32")
    """
    if zero_weights not in ("fp32", "module") or (zero_weights != "fp32" and fmt != DEEPSPEED):
        flag = spell(f"zero_weights={zero_weights!r}", f"--zero-weights {zero_weights}")
        raise ArgumentError(
            f"{flag} is for DeepSpeed ZeRO folders ('fp32' or 'module'), and {path} is a {fmt}; leave it out"
        )
    if fmt == ZIP:
        refuse_rank_file(path)
