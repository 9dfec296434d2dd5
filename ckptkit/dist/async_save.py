"""Background checkpoint saving: training waits for the host copy only.

Everything that involves other ranks or the live state happens in the caller's thread: the
RNG gather, and the copy of every tensor to host memory (pinned and reused on CUDA). The
background thread then serialises and writes durably (rank 0) and takes part in the outcome
broadcast on its own control group, so it never shares a group with the training thread. At
most one save is in flight; the next save, :meth:`wait` or :meth:`close` waits for it and
re-raises its error.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._state import build_training_state
from . import collectives as _dist
from .rank0 import write_and_agree

_CHANNEL = "background"


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

    def save(self, obj: Any, path: str | os.PathLike[str], *, on_done: Callable[[], None] | None = None) -> None:
        """Like :func:`save_on_master`, returning once ``obj`` is copied. Must be called on all ranks."""
        self.wait()
        staged = self._stage(obj) if _dist.rank() == 0 else None
        self._start(staged, Path(path), on_done)

    def save_training_state(self, path: str | os.PathLike[str], *, on_done: Callable[[], None] | None = None, **state: Any) -> None:
        """Like :func:`save_training_state`, returning once the state is copied. Must be called on all ranks.

        ``on_done`` runs (in the background thread) after the file is complete and durable on
        every rank, e.g. to update a ``latest`` pointer.
        """
        self.wait()
        built = build_training_state(timeout=self.timeout, **state)
        staged = self._stage(built) if built is not None else None
        self._start(staged, Path(path), on_done)

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

    def _start(self, staged: Any, path: Path, on_done: Callable[[], None] | None) -> None:
        _dist.ensure_channel(self.timeout, _CHANNEL)  # a collective: create the group here, not in the thread

        def work() -> None:
            try:
                write_and_agree(staged, path, timeout=self.timeout, channel=_CHANNEL)
                if on_done is not None:
                    on_done()
            except BaseException as e:  # kept and re-raised in the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=work, name="ckptkit-async-save", daemon=False)
        self._thread.start()

    def _stage(self, obj: Any) -> Any:
        """Copy every storage to host memory now, once each: views and tied weights stay shared,
        so the file is the one a synchronous save writes. Containers are rebuilt, other values
        shared."""
        import torch

        hosts: dict[tuple[str, int], Any] = {}  # (device, data_ptr) of a live storage -> its host copy
        device_copies = 0

        def host_storage(t: torch.Tensor) -> Any:
            nonlocal device_copies
            storage = t.untyped_storage()
            ident = (str(storage.device), storage.data_ptr())
            if ident in hosts and hosts[ident].nbytes() == storage.nbytes():
                return hosts[ident]
            if storage.device.type == "cpu":
                copy = storage.clone()
            else:
                # Pinned buffers are reused between saves (the next save waits for this one).
                i, device_copies = device_copies, device_copies + 1
                if i < len(self._pinned) and self._pinned[i].numel() == storage.nbytes():
                    buf = self._pinned[i]
                else:
                    buf = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                    self._pinned[i:i + 1] = [buf]
                copy = buf.untyped_storage()
                copy.copy_(storage, non_blocking=True)
            hosts[ident] = copy
            return copy

        def copy(t: torch.Tensor) -> torch.Tensor:
            view = torch.empty(0, dtype=t.dtype).set_(host_storage(t), t.storage_offset(), t.shape, t.stride())
            return torch.nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else view

        def walk(node: Any) -> Any:
            if isinstance(node, torch.Tensor):
                return copy(node.detach() if not isinstance(node, torch.nn.Parameter) else node)
            if isinstance(node, Mapping):
                out: dict[Any, Any] = OrderedDict() if isinstance(node, OrderedDict) else {}
                for k, v in node.items():
                    out[k] = walk(v)
                if hasattr(node, "_metadata"):
                    out._metadata = node._metadata  # type: ignore[attr-defined]
                return out
            if isinstance(node, list):
                return [walk(v) for v in node]
            if isinstance(node, tuple) and not hasattr(node, "_fields"):
                return tuple(walk(v) for v in node)
            return node

        with torch.no_grad():
            staged = walk(obj)
        if device_copies:
            torch.cuda.current_stream().synchronize()  # copies done before training mutates the tensors
        return staged
