"""Background checkpoint saving: training waits for the host copy only.

Everything that involves other ranks or the live state happens in the caller's thread: the
RNG gather, and the copy of every tensor to host memory (pinned and reused on CUDA). The
background thread then serialises and writes durably (rank 0) and takes part in the outcome
broadcast on its own control group, so it never shares a group with the training thread. At
most one save is in flight; the next save, :meth:`wait` or :meth:`close` waits for it and
re-raises its error.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..distributed import collectives as _dist
from ..io.remote import as_destination
from ..training.state import build_training_state
from .save import write_and_agree

_CHANNEL = "background"
# Host copies of device storages -> the device tag the original had ("cuda:0"), so the file
# records where the tensors lived, exactly as a synchronous save of the live tensors does.
# Keyed by storage object (``_cdata``, its StorageImpl, unique while it lives; the staged copy
# lives until its key is dropped), never by data pointer: every zero-size storage has
# data_ptr 0, and any other torch.save in the process would take the tag.
_STAGED_TAGS: dict[int, str] = {}
_tagger_registered = False


def _tag_as(host_storage: Any, tag: str) -> int:
    global _tagger_registered
    if not _tagger_registered:
        import torch

        # Priority 0 runs before torch's own taggers (cpu is 10); None defers to them.
        torch.serialization.register_package(0, _staged_tag, lambda s, location: None)
        _tagger_registered = True
    _STAGED_TAGS[host_storage._cdata] = tag
    return int(host_storage._cdata)


def _staged_tag(storage: Any) -> str | None:
    tag = _STAGED_TAGS.get(storage._cdata)
    # A new string at each call, as torch's own device taggers return: pickle memoizes by object,
    # so one shared string would be written as a back-reference wherever two tensors share a
    # storage (tied weights), and the file would differ from a synchronous save's.
    return None if tag is None else "".join(tag.partition(":"))


class AsyncSaver:
    """Save checkpoints in the background; results are identical to synchronous saves.

    Example:
        >>> saver = AsyncSaver()  # doctest: +SKIP
        >>> saver.save_training_state(path, model=ddp, optimizer=opt, step=step)  # doctest: +SKIP
        >>> saver.close()  # before exiting: waits for the last write  # doctest: +SKIP
    """

    def __init__(self, *, timeout: float = _dist.DEFAULT_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned: list[Any] = []
        self._tagged: list[int] = []  # _STAGED_TAGS keys of the save being staged

    def save(self, obj: Any, path: str | os.PathLike[str], *, on_done: Callable[[], None] | None = None) -> None:
        """Like :func:`save_on_master`, returning once ``obj`` is copied. Must be called on all ranks."""
        self.wait()
        staged = self._stage(obj) if _dist.rank() == 0 else None
        self._start(staged, as_destination(path), on_done)

    def save_training_state(
        self, path: str | os.PathLike[str], *, on_done: Callable[[], None] | None = None, **state: Any
    ) -> None:
        """Like :func:`save_training_state`, returning once the state is copied. Must be called on all ranks.

        ``on_done`` runs (in the background thread) after the file is complete and durable on
        every rank, e.g. to update a ``latest`` pointer.
        """
        self.wait()
        built = build_training_state(timeout=self.timeout, **state)
        staged = self._stage(built) if built is not None else None
        self._start(staged, as_destination(path), on_done)

    def wait(self) -> None:
        """Block until the save in flight (if any) is durable; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self, staged: Any, path: Path | str, on_done: Callable[[], None] | None) -> None:
        _dist.ensure_channel(self.timeout, _CHANNEL)  # a collective: create the group here, not in the thread
        tagged, self._tagged = self._tagged, []

        def work() -> None:
            try:
                write_and_agree(staged, path, timeout=self.timeout, channel=_CHANNEL)
                if on_done is not None:
                    on_done()
            except BaseException as e:  # kept and re-raised in the training thread by wait()
                self._error = e
            finally:
                for key in tagged:
                    _STAGED_TAGS.pop(key, None)

        self._thread = threading.Thread(target=work, name="ckptkit-async-save", daemon=False)
        self._thread.start()

    def _stage(self, obj: Any) -> Any:
        """Copy every tensor to host memory now, each storage once: views and tied weights stay
        shared, so the file is the one a synchronous save writes. Containers are rebuilt (their
        type kept), other values shared."""
        import torch

        hosts: dict[int, Any] = {}  # a live storage (its StorageImpl, shared by its views) -> its host copy
        cuda_devices: set[Any] = set()
        device_copies = 0

        def host_storage(t: torch.Tensor) -> Any:
            nonlocal device_copies
            storage = t.untyped_storage()
            ident = storage._cdata
            if ident in hosts:
                return hosts[ident]
            if storage.device.type == "cpu":
                copy = storage.clone()
            else:
                cuda = storage.device.type == "cuda"
                # Pinned buffers are reused between saves (the next save waits for this one).
                i, device_copies = device_copies, device_copies + 1
                if i < len(self._pinned) and self._pinned[i].numel() == storage.nbytes():
                    buf = self._pinned[i]
                else:
                    buf = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
                    self._pinned[i : i + 1] = [buf]
                copy = buf.untyped_storage()
                copy.copy_(storage, non_blocking=cuda)  # other accelerators: a blocking copy
                if cuda:
                    cuda_devices.add(storage.device)
                self._tagged.append(_tag_as(copy, torch.serialization.location_tag(storage)))
            hosts[ident] = copy
            return copy

        def copy_tensor(t: torch.Tensor) -> torch.Tensor:
            plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            if t.device.type == "meta":
                return t  # no data to copy
            if plain and not t.is_quantized:
                out = torch.empty(0, dtype=t.dtype).set_(host_storage(t), t.storage_offset(), t.shape, t.stride())
                # The storage holds the bits before a lazy conjugation or negation: apply it again.
                out = out.conj() if t.is_conj() else out
                out = torch._neg_view(out) if t.is_neg() else out
            else:  # sparse, quantized, subclasses: copied as torch copies them
                out = t.detach().to("cpu", copy=True)
            if isinstance(t, torch.nn.Parameter):
                return torch.nn.Parameter(out, requires_grad=t.requires_grad)
            return out.requires_grad_() if t.requires_grad else out

        def walk(node: Any) -> Any:
            if isinstance(node, torch.Tensor):
                return copy_tensor(node)
            if isinstance(node, dict):
                out = copy.copy(node)  # keeps OrderedDict/defaultdict and attributes such as _metadata
                for k, v in node.items():
                    out[k] = walk(v)
                return out
            if isinstance(node, Mapping):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            if isinstance(node, tuple):
                items = [walk(v) for v in node]
                return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
            return node

        with torch.no_grad():
            staged = walk(obj)
        for device in cuda_devices:  # copies done before training mutates the tensors
            torch.cuda.current_stream(device).synchronize()
        return staged
