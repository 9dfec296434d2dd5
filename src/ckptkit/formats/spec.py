"""What every format is, in one shape: the verbs its package implements and the facts the
operations ask of it instead of branching on its name.

A format's package (``formats/safetensors/`` ...) implements the verbs in a module named
``format.py`` (its detection rule in ``detect.py``, which the other verbs' modules import) and
describes itself there with one :class:`CheckpointFormat`; ``formats/registry.py``
lists them. The verbs:

- ``detect``: whether a path is one (its :class:`~.detect.Signature`, in the package's
  ``detect.py``, with the format's name and the file names that mark it).
- ``open``: the checkpoint as an object tree whose tensors are entries (a :class:`View`), torch-free;
  ``NeedsTorch`` where it holds what this path does not model. None: only torch reads it.
- ``check``: what ``verify`` reports of it (:class:`~.integrity.Check` s), through the same parser
  ``open`` uses.
- ``describe``: each tensor's :class:`TensorInfo` and the metadata ``inspect`` shows (on the view).
- ``write``: the torch-free writer of its entries (``write_entries``), and its torch half's
  ``write`` for objects torch built.
- ``read`` (its torch half): the checkpoint as Python objects, tensors where :class:`Placement` says.

The torch half is the package's ``torch.py``, imported only when a verb needs torch.

Example:
    >>> from ckptkit.formats.registry import get
    >>> get("safetensors").suffixes, get("dcp").folder
    (('.safetensors',), True)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from ..errors import CheckpointWriteError, summarize
from .detect import Signature
from .entry import Entry, map_entries

if TYPE_CHECKING:
    from ..io.fileio import Progress
    from .integrity import Check, Damage
    from .producers import Producer


@dataclass
class TensorInfo:
    """One weight tensor, as ``inspect`` lists it. ``stored`` is the size of its storage, 0 when an
    earlier tensor shares it (tied weights are stored once)."""

    name: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    stored: int = 0


# (info, storage identity, storage bytes) of a tensor, by name and leaf
Info = Callable[[str, Any], tuple[TensorInfo, Any, int]]


class View(Protocol):
    """An opened checkpoint, torch-free: its object tree with byte-locating leaves.

    Every format's ``open`` returns one; convert copies from it, inspect describes it.
    """

    obj: Any

    @property
    def damage(self) -> Damage:
        """Bytes found to differ from their recorded CRC-32 while copied (raised once all are written)."""
        ...

    @property
    def name(self) -> str:
        """The path it was opened from, as messages name it."""
        ...

    @property
    def nbytes(self) -> int:
        """Source bytes its tensors are copied from (what progress is measured against)."""
        ...

    @property
    def notes(self) -> list[str]:
        """What a report should say of where the weights came from."""
        ...

    @property
    def pickled_module(self) -> str:
        """A whole pickled module's class (``DataParallel(ToyCNN)``); ``obj`` is then its state_dict()."""
        ...

    def output_metadata(self) -> dict[str, str]:
        """The ``__metadata__`` a safetensors output carries: a safetensors source's own, else
        ``{"format": "pt"}``."""
        ...

    def is_leaf(self, value: Any) -> bool:
        """Whether ``value`` in :attr:`obj` is a tensor."""
        ...

    def entry(self, leaf: Any, name: str) -> Entry:
        """Leaf ``name`` as an entry a writer copies (``NeedsTorch`` where its bytes need torch)."""
        ...

    def records(self) -> tuple[dict[str, Entry], str, str] | None:
        """A torch zip's storage records by key, copied as they are, with the zip's record prefix
        and byte order; None for other formats."""
        ...

    def describe(self) -> tuple[Info, dict[str, Any], Producer | None]:
        """How to describe each tensor, the metadata ``inspect`` shows, and who wrote it where the
        format itself says (a ZeRO folder; a Trainer folder), else None."""
        ...

    def unread(self) -> list[str]:
        """After a copy: the source's checksummed records that it never read (what a model-only
        copy leaves behind, such as optimizer state), so never checked; ``verify`` checks them."""
        ...

    def close(self) -> None: ...


class EntryView:
    """What the views whose tensors are entries themselves (a DCP or ZeRO folder's) answer alike;
    a subclass sets ``folder`` and ``leaf_type``, and says what differs (``notes``, ``describe``)."""

    folder: Path
    leaf_type: type

    @property
    def name(self) -> str:
        return str(self.folder)

    @property
    def notes(self) -> list[str]:
        return []

    @property
    def pickled_module(self) -> str:
        return ""

    def output_metadata(self) -> dict[str, str]:
        return {"format": "pt"}

    def is_leaf(self, value: Any) -> bool:
        return isinstance(value, self.leaf_type)

    def entry(self, leaf: Any, name: str) -> Any:
        return leaf  # its tensors are entries already

    def records(self) -> None:
        return None

    def unread(self) -> list[str]:
        return []

    @staticmethod
    def entry_info(name: str, t: Any) -> tuple[TensorInfo, Any, int]:
        """An entry's :class:`TensorInfo`, each entry its own storage."""
        return TensorInfo(name, list(t.shape), t.dtype, "cpu", t.nbytes), id(t), t.nbytes


def entries_of(view: View, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each of ``view``'s tensors as the entry a writer copies."""
    return {k: view.entry(v, k) if view.is_leaf(v) else v for k, v in state.items()}


def entry_tree(view: View, obj: Any) -> Any:
    """``obj``, a whole tree, with each of ``view``'s tensors (at any depth) as the entry a writer copies."""

    def entry(v: Any, k: str) -> Any:
        return view.entry(v, k) if view.is_leaf(v) else v

    return map_entries(obj, entry, lambda v: isinstance(v, Entry) or view.is_leaf(v))


class Placement(Protocol):
    """Where a torch read puts tensors (resolved from the caller's ``map_location``, once)."""

    @property
    def map_location(self) -> Any:
        """For formats whose storages record their device: as ``torch.load`` takes it."""
        ...

    def device(self, source: str, what: str) -> str:
        """For formats that record none: the one device (``ArgumentError`` where the caller's
        ``map_location`` is not a device)."""
        ...


@dataclass(frozen=True)
class CheckpointFormat:
    """One format: its facts, its torch-free verbs, and where its torch half is.

    Attributes:
        signature: what it looks like on disk (its package's ``detect.py``): its ``name``, as
            reports spell it, ``what`` messages call one, and its detection rule.
        package: its package, whose ``torch`` module is its torch half.
        check: ``check(path, full, progress)``: what ``verify`` reports.
        check_opened: ``check_opened(view)``: the same structural checks (``full`` False) of a
            view ``open`` returned, for a format whose check reads what its open reads (DCP's
            chunk headers): a convert then opens it once.
        open: ``open(path, zero_weights=...)``: a :class:`View`; None: only torch reads it.
        write_entries: ``write_entries(target, view, obj, state, plan)``: the torch-free writer
            (``target`` an open file, or the folder's path); None: it is written by torch alone.
        suffixes: the file suffixes that name it as an output (lowercase).
        folder: an output written as a folder (its writer owns the temp folder and the swap).
        device_tags: its storages record their device, so ``map_location`` is torch.load's.
        trust_matters: its pickles can name code; False where they are read inertly whatever
            ``trust`` says (DeepSpeed's records).
        tensors_only: it holds tensors only: anything beside the weights needs ``model_only``.
        keeps_metadata: its outputs carry the source's safetensors metadata
            (:meth:`View.output_metadata`).
        published_by: for a folder format, whether a file of that name is what makes the folder
            readable (its index, DCP's ``.metadata``): copied last, once every other file is in place.
        scan_globals: one pickle whose globals can be listed, and tried with torch's weights-only
            unpickler (torch's own formats).
        partial: raises where a path of this format is one part of a checkpoint given alone.
        module_name: the class of a whole pickled module the file holds (``""``: none).
        ties: the names a written file stores once (``"alias is target"``).
        producer: who wrote a checkpoint at this path, from its files alone, whichever reader runs.
        owns: for a folder output its writer fills: which file names are its own, and what they
            are called; ``--force`` replaces a folder holding nothing else.
        unstacks_layers: ``open(path, unstack_layers=True)`` gives each layer of the tensors a
            block stacks (megatron-core's) its own keys.
    """

    signature: Signature
    package: str
    check: Callable[[Path, bool, Progress | None], list[Check]]
    open: Callable[..., View] | None = None
    check_opened: Callable[[View], list[Check]] | None = field(default=None, repr=False)
    write_entries: Callable[[BinaryIO | Path, View, Any, Any, WritePlan], Any] | None = None
    suffixes: tuple[str, ...] = ()
    folder: bool = False
    device_tags: bool = False
    trust_matters: bool = True
    tensors_only: bool = False
    keeps_metadata: bool = False
    published_by: Callable[[str], bool] = field(default=lambda name: False, repr=False)
    scan_globals: bool = False
    partial: Callable[[Path], None] | None = field(default=None, repr=False)
    module_name: Callable[[str | os.PathLike[str]], str] | None = field(default=None, repr=False)
    ties: Callable[[Path], list[str]] | None = field(default=None, repr=False)
    producer: Callable[[Path], Producer | None] | None = field(default=None, repr=False)
    owns: tuple[Callable[[str], bool], str] | None = field(default=None, repr=False)
    unstacks_layers: bool = False

    @property
    def name(self) -> str:
        """As reports spell it (``"safetensors"``)."""
        return self.signature.name

    @property
    def what(self) -> str:
        """As messages name one (``"a safetensors file"``)."""
        return self.signature.what

    def torch(self) -> ModuleType:
        """The torch half: ``read(path, *, placement, trust, allow_globals, mmap, zero_weights)`` and
        ``write(target, obj, state, *, dest, plan)``. Importing it imports torch."""
        return importlib.import_module(f"{self.package}.torch")


# Starts the other workers on the temp folder, each with its list of files; returns finish(ok):
# with True, waits for them all (raising the first failure, naming the worker) and returns what
# each one's writer reported (Part.reported); with False (this process failed), stops them. See
# WritePlan.spread.
Spread = Callable[[Path, list[list[str]]], Callable[[bool], list[Any]]]


def balanced(sizes: Mapping[str, int], count: int) -> dict[str, int]:
    """Which of ``count`` processes writes each of ``sizes``' names (a file, a tensor), about equal
    in bytes: each, largest first, to the one with the fewest so far. Every process that plans
    the same output splits it alike.

    Example:
        >>> balanced({"a": 5, "b": 3, "c": 3}, 2)
        {'a': 0, 'b': 1, 'c': 1}
    """
    loads, owner = [0] * count, {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        i = loads.index(min(loads))
        loads[i] += sizes[name]
        owner[name] = i
    return owner


@dataclass
class Part:
    """A worker's share of a sharded folder: write ``files`` (of the plan every worker makes
    alike) into the writer's temp ``folder``, nothing else; ``share`` is what it reports back,
    ``reported`` what its writer tells the first process's (a DCP file's items' places).
    ``receive``: where the folder and files are known only once the plan is (another rank's
    convert asks rank 0 for them), what gives them."""

    folder: Path
    files: list[str]
    share: Any = None
    receive: Callable[[], tuple[Path, list[str]]] | None = None
    reported: Any = None

    def take(self, dest: Path, planned: Iterable[str]) -> None:
        """Before a worker writes: its folder and files (from :attr:`receive`, where rank 0 gives
        them), which must be among the files this process ``planned`` for ``dest``.

        Raises:
            CheckpointWriteError: they are not (the processes planned differently: a ckptkit bug).
        """
        if self.receive is not None:
            self.folder, self.files = self.receive()
        if not set(self.files) <= set(planned):
            raise CheckpointWriteError(
                f"cannot write {dest}: a worker planned other files than {summarize(self.files, 2)}; "
                "this is a ckptkit bug, please report it with the command that did it"
            )


@dataclass
class WritePlan:
    """What a writer needs beyond the tree: a folder's shard limit, progress, the source's name.

    Attributes:
        max_shard_size: a sharded folder's limit in bytes (0: not a sharded output).
        progress: called with bytes as they are copied.
        source: the source's name, for messages.
        copy_storages: a torch zip written from a torch zip may copy its storages as they are
            (False where the tensors are cast as they are copied).
        workers: a sharded folder's files split among this many processes, this one included
            (in each of them).
        spread: with ``workers``, starts the others (the writer keeps the first share).
        part: in a worker, its share: only those shard files are written.
        extra: other files a folder output holds (``config.json``), by name: written with the
            shards, before the index.
    """

    max_shard_size: int = 0
    progress: Progress | None = None
    source: str = ""
    copy_storages: bool = True
    workers: int = 1
    spread: Spread | None = None
    part: Part | None = None
    extra: dict[str, bytes] = field(default_factory=dict)
