"""``convert --workers N``: a sharded output's files written by N processes at once.

Every worker runs the same convert (the same checks, the same plan of files) and writes only
its share of them (Hugging Face shards, or a DCP folder's ``.distcp`` files) into the parent's
temp folder (:class:`~..formats.spec.Part`), or
streams them to the store where the parent's output streams to an S3 prefix, reading a URL's
source through ranges as the parent does (:mod:`..io.ranged`, :mod:`..io.streamed`); the
parent writes the first share itself, then the index (or ``.metadata``) once every worker has written, checked
and fsynced its files, and publishes the folder. A worker that fails, or dies, fails the whole
convert and leaves no folder; the error names the worker, its shards and its cause. Workers are
spawned (a fresh interpreter, as torch's own multiprocessing does for safety), so a torch-free
convert stays torch-free in each.

Example:
    >>> convert_checkpoint("ckpt.dcp", "hf/", max_shard_size="2GB", workers=4)  # doctest: +SKIP
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointWriteError, CkptkitError, cause, summarize
from ..formats.source import NeedsTorch
from ..formats.spec import Part
from ..io import ranged, streamed

_POLL = 0.2  # seconds between progress updates while the parent waits for its workers


@dataclass
class Share:
    """What a worker reports back for the parent's report: the tensors it cast (name -> dtype
    before), the weights it merged an adapter into, and the source records it did not read."""

    cast: dict[str, str]
    merged: list[str]
    unread: list[str]
    runs: dict[str, dict[int, int]] = field(default_factory=dict)  # the source's objects' runs it read, by path
    sent: dict[str, list[str]] = field(default_factory=dict)  # shards it streamed to the output's store: their checks
    reported: Any = None  # what its writer told the parent's (Part.reported)


@dataclass
class Workers:
    """Runs ``convert(src, dst, **options, part=...)`` in a spawned process per share; call it
    with the temp folder and the other processes' shares (:data:`~..formats.spec.Spread`).
    ``shares`` collects what they report; ``progress`` hears of their bytes as they copy them.
    ``elsewhere``: the source's paths that stand for objects in a store (:func:`~..io.ranged.stand_ins`),
    which each worker reads through ranges too; the runs they read count towards each object's
    whole CRC-32 here."""

    convert: Callable[..., Any]
    src: str
    dst: str
    options: dict[str, Any]
    progress: Callable[[int], None] | None = None
    shares: list[Share] = field(default_factory=list)
    elsewhere: list[ranged.Stand] = field(default_factory=list)

    def __call__(self, folder: Path, shares: list[list[str]]) -> Callable[[bool], list[Any]]:
        ctx = multiprocessing.get_context("spawn")
        count = len(shares) + 1  # this process too; fewer than asked where there are fewer shards
        copied = ctx.Value("q", 0)  # bytes the workers have copied, for the parent's progress
        stream_to = streamed.folder_stand_in(folder)  # an output streaming to a store: theirs stream too
        for files in shares:
            streamed.expect_streamed(folder, files)
        running = []
        try:
            for i, files in enumerate(shares, 1):
                ours, theirs = ctx.Pipe(duplex=False)
                part = Part(folder, files)
                args = (self.convert, self.src, self.dst, self.options, part, copied, theirs, self.elsewhere, stream_to)
                proc = ctx.Process(target=_work, args=args, name=f"ckptkit-worker-{i}", daemon=True)
                proc.start()
                theirs.close()  # the child holds its end: EOF here once it exits
                running.append((i, files, proc, ours))
        except BaseException:
            _stop(running)
            raise
        seen = 0

        def tick() -> None:
            nonlocal seen
            if self.progress is not None and copied.value != seen:
                self.progress(copied.value - seen)
                seen = copied.value

        def finish(ok: bool) -> list[Any]:
            if not ok:  # this process failed: the others' work is dropped with the folder
                _stop(running)
                return []
            try:
                for i, files, proc, conn in running:
                    while not conn.poll(_POLL):
                        tick()
                    try:
                        status, value = conn.recv()
                    except EOFError:  # it died before it could say: killed, or out of memory
                        proc.join()
                        raise CheckpointWriteError(
                            f"cannot write {self.dst}: worker {i} of {count} ({_named(files)}) exited with "
                            f"code {proc.exitcode} before it finished; nothing was written"
                        ) from None
                    proc.join()
                    if status != "ok":
                        kind, text = value
                        # needing torch is no failure: the parent converts alone, as one process would say why
                        raise kind(text if kind is NeedsTorch else f"worker {i} of {count} ({_named(files)}): {text}")
                    self.shares.append(value)
                    streamed.add_streamed(folder, value.sent)  # before anything else can fail: removed then
                    ranged.add_runs(value.runs)
                tick()
                return [share.reported for share in self.shares]
            finally:
                _stop(running)

        return finish


def _named(files: list[str]) -> str:
    kind = "shard" if files[0].endswith(".safetensors") else "file"  # a DCP folder's .distcp: a file
    return f"{kind} {files[0]}" if len(files) == 1 else f"{kind}s {summarize(files, 2)}"


def _stop(running: list[tuple[int, list[str], Any, Any]]) -> None:
    for _, _, proc, conn in running:
        if proc.is_alive():
            proc.terminate()
        proc.join()
        conn.close()


def _work(
    convert: Callable[..., Any],
    src: str,
    dst: str,
    options: dict[str, Any],
    part: Part,
    copied: Any,
    conn: multiprocessing.connection.Connection,
    elsewhere: list[ranged.Stand],
    stream_to: str | None,
) -> None:
    """A worker's body: the convert with its part; sends ``("ok", Share)`` or ``("error", (type, text))``."""

    def progress(n: int, total: int) -> None:  # as convert calls it; the parent knows the total
        with copied.get_lock():
            copied.value += n

    try:
        with ranged.standing_in(elsewhere) as objects, streamed.streaming_into(part.folder, stream_to) as sent:
            convert(src, dst, **options, progress=progress, part=part)
            part.share.runs = {path: obj.run_crcs() for path, obj in objects.items()}
            part.share.sent = {name: how for name, how in sent.items() if how}
        conn.send(("ok", part.share))
    except CkptkitError as e:  # the parent raises it again, naming this worker
        conn.send(("error", (type(e), cause(e, typed=False))))
    except NeedsTorch as e:  # the parent converts through torch instead, alone, as one process would
        conn.send(("error", (NeedsTorch, str(e))))
    except BaseException as e:  # noqa: BLE001 - anything else is reported as a failed write, not lost
        conn.send(("error", (CheckpointWriteError, cause(e))))
    finally:
        conn.close()
