"""One writer per folder: a lease in a small record, taken atomically, renewed while the writer lives.

The record ``.ckptkit-writer`` in the folder names its writer: the host, the pid, since when it
writes there, and until when its lease runs. The writer renews the lease from a daemon thread
every ``LEASE_S / 4`` seconds, and removes the record when it is done with the folder: its
objects collected (the removal runs on the lease's own thread, never on the one that collected
them: that may be any thread, the very one that serves the store), or the interpreter exiting. Another process that finds the record is refused
at once, unless the writer it names is dead: on this host, its pid is gone (kill -9 runs no
cleanup code); on any host, its lease ran out (hosts' clocks are assumed to agree within
seconds, as NTP keeps them). A suspended or cut-off writer whose lease ran out finds, on its
next check, that the folder was taken over, and stops before it moves ``latest`` or prunes.

The record changes hands atomically: on a local or shared filesystem it is created by ``link``
(which refuses an existing name, on NFS too) and taken from a dead writer by renaming it aside
and checking that what moved is the record judged dead; on S3 by conditional PUTs
(``If-None-Match: *`` to create, ``If-Match: <ETag>`` to renew or take over).

Example:
    >>> lease = hold(locate("runs/a/checkpoints"))  # doctest: +SKIP
    >>> lease.check("commit runs/a/checkpoints/step_000000010.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import threading
import time
import weakref
from pathlib import Path

from ..errors import CheckpointWriteError, CkptkitError
from . import records
from .atomic import atomic_write, describe_error, fsync_dir, host_tag, pid_alive, temp_path
from .store import Location

NAME = ".ckptkit-writer"
LEASE_S = 60.0  # a writer that has not renewed for this long may be taken over from any host
_HOST = host_tag(platform.node())  # as temp files name it
_CLAIMS = 8  # rounds of a claim; each lost round means another process changed the record meanwhile


@dataclasses.dataclass(frozen=True)
class Holder:
    """What the record says: who writes the folder, since when, and until when its lease runs."""

    host: str
    tag: str  # the host's tag (:func:`.atomic.host_tag`): what tells this host from another
    pid: int
    since: str
    expires: float  # seconds since the epoch, on the holder's clock
    token: str  # this claim's: a process that claims twice holds two different tokens

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, data: bytes, where: str) -> Holder:
        try:
            fields = json.loads(data)
            return cls(
                str(fields["host"]),
                str(fields["tag"]),
                int(fields["pid"]),
                str(fields["since"]),
                float(fields["expires"]),
                str(fields["token"]),
            )
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointWriteError(
                f"{where}: expected a ckptkit writer record (host, pid, since, lease), found {data[:80]!r} ({e}); "
                "if no ckptkit run writes this folder, delete it"
            ) from None

    def dead(self) -> bool:
        """Whether another process may take the folder: this host's pid is gone, or the lease ran out."""
        return (self.tag == _HOST and not pid_alive(self.pid)) or time.time() > self.expires

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since}"


def _me(token: str, since: str) -> Holder:
    return Holder(platform.node(), _HOST, os.getpid(), since, time.time() + LEASE_S, token)


# -- the record's storage: a local file, or an object with conditional PUTs ------------------


def _read(at: Location) -> tuple[bytes, str] | None:
    """The record's bytes and version (the ETag of an object, the bytes themselves of a file)."""
    if at.remote:
        return records.read_record(at.spelled)
    try:
        data = Path(at.spelled).read_bytes()
    except FileNotFoundError:
        return None
    return data, data.decode(errors="replace")


def _create(at: Location, data: bytes) -> str | None:
    """Write the record where there is none: its version, or None where there is one."""
    if at.remote:
        return records.put_record(at.spelled, data, if_match=None)
    path = Path(at.spelled)
    tmp = _staged(path, data)
    try:
        if not _publish(tmp, path):
            return None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return data.decode(errors="replace")


def _publish(tmp: Path, path: Path) -> bool:
    """Give the whole file ``tmp`` the name ``path`` unless that name exists; whether it did."""
    try:
        os.link(tmp, path)  # atomic, whole, and refused where the name exists (NFS too)
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links (FUSE mounts of object stores, FAT)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:  # a reader in between sees a short record: refused, not taken
            f.write(tmp.read_bytes())
            f.flush()
            os.fsync(f.fileno())
    return True


def _staged(path: Path, data: bytes) -> Path:
    """``data`` in a new, fsynced temp file beside ``path`` (named as :mod:`.atomic` names them)."""
    tmp = temp_path(path)
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _renew(at: Location, data: bytes, version: str) -> str | None:
    """Replace the record that is still ``version`` (ours): the new version, or None where another replaced it."""
    if at.remote:
        return records.put_record(at.spelled, data, if_match=version)
    found = _read(at)
    if found is None:  # moved aside a moment by a process that misjudged it, or deleted by hand
        return _create(at, data)
    if found[1] != version:
        return None
    # Not compare-and-swap: only a process that judged this record dead could act in between,
    # and this one is alive, so that is one whose view of our lease ran out; its next check or
    # ours sees the other's token.
    with atomic_write(at.spelled) as f:
        f.write(data)
    return data.decode(errors="replace")


def _take_over(at: Location, data: bytes, version: str) -> str | None:
    """Replace the record of a dead writer, still ``version``: the new version, or None where another changed it."""
    if at.remote:
        return records.put_record(at.spelled, data, if_match=version)
    path = Path(at.spelled)
    aside = temp_path(path)  # named as temp files are: removed as debris if this process dies here
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    try:
        if aside.read_bytes().decode(errors="replace") != version:  # moved another's record: give it back
            _publish(aside, path)
            return None
        return _create(at, data)
    finally:
        aside.unlink(missing_ok=True)


def _delete(at: Location, version: str) -> None:
    if at.remote:
        records.delete_record(at.spelled, version)
        return
    found = _read(at)
    if found is not None and found[1] == version:
        Path(at.spelled).unlink(missing_ok=True)


# -- the lease ----------------------------------------------------------------------------------


class _State:
    """What the heartbeat and the release share with a lease (they must not hold the lease itself)."""

    def __init__(self, record: Location, holder: Holder, version: str) -> None:
        self.record = record
        self.holder = holder
        self.version = version
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.lost: str | None = None  # why this process no longer holds the folder
        self.collected = False  # the lease was collected: its thread releases the folder
        self.released = False
        self.failure: str | None = None  # the last renewal that failed, if the one after has not worked


class Lease:
    """This process's hold on one folder. Get it from :func:`hold`."""

    def __init__(self, folder: str, state: _State) -> None:
        self.folder = folder
        self._state = state
        # Collection only wakes the heartbeat, which releases: a finalizer runs on whatever thread the
        # collector interrupts, and I/O there can wait on that thread itself (a server in-process)
        # or on a lock it holds. At interpreter exit, _release_all releases instead.
        weakref.finalize(self, _collected, state).atexit = False
        # A daemon: a training process exits without waiting for it.
        threading.Thread(target=_beat, args=(state,), name=f"ckptkit lease {folder}", daemon=True).start()

    @property
    def holder(self) -> Holder:
        return self._state.holder

    @property
    def lost(self) -> str | None:
        """Why this process no longer holds the folder (its heartbeat found another's record), or None."""
        return self._state.lost

    def check(self, doing: str) -> None:
        """Renew the lease now, and raise unless this process still holds the folder.

        Raises:
            CheckpointWriteError: another writer took the folder over, or the lease cannot be renewed.
        """
        _renewal(self._state)
        state = self._state
        if state.lost is not None:
            raise CheckpointWriteError(f"cannot {doing}: {state.lost}")
        if state.failure is not None:
            raise CheckpointWriteError(
                f"cannot {doing}: renewing this writer's lease in {state.record.spelled} failed ({state.failure}); "
                "check the folder or the store, then resume from the latest checkpoint"
            )


def _renewal(state: _State) -> None:
    """Renew, or find that the folder was lost; failures are kept in ``state`` for :meth:`Lease.check`."""
    with state.lock:
        if state.lost is not None or state.stop.is_set():
            return
        new = dataclasses.replace(state.holder, expires=time.time() + LEASE_S)
        data = new.encode()
        try:
            renewed = _renew(state.record, data, state.version)
            found = None if renewed is not None else _read(state.record)
        except (OSError, CkptkitError) as e:  # a blip: the next beat tries again, a check reports it
            state.failure = str(e).splitlines()[0] if str(e) else type(e).__name__
            return
        state.failure = None
        if renewed is not None:
            state.holder, state.version = new, renewed
            return
        other = "someone removed it" if found is None else _who(found[0], state.record.spelled)
        state.lost = (
            f"this process (pid {os.getpid()}) no longer holds {state.record.spelled}: {other}. This writer's lease "
            f"lapsed (it was stopped or cut off for over {LEASE_S:.0f} s), so the folder was taken over; "
            "stop this run: the other one writes here now"
        )
        state.stop.set()


def _who(data: bytes, where: str) -> str:
    try:
        return f"{Holder.decode(data, where).describe()} writes it now"
    except CheckpointWriteError:
        return "its record now holds something else"


def _beat(state: _State) -> None:
    while not state.stop.wait(LEASE_S / 4):
        _renewal(state)
    if state.collected:
        _release(state)


def _collected(state: _State) -> None:
    state.collected = True
    state.stop.set()


def _release(state: _State) -> None:
    """Give the folder up: remove the record if it is still ours (never another writer's)."""
    state.stop.set()
    if state.holder.pid != os.getpid():  # a forked child: the folder is its parent's
        return
    with state.lock:
        if state.released:
            return
        state.released = True
        if state.lost is None:
            # Best effort: a store that is gone (or an interpreter shutting down) leaves a record
            # whose lease runs out, which the next writer takes over.
            with contextlib.suppress(OSError, CkptkitError):
                _delete(state.record, state.version)


_HELD: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
_HELD_LOCK = threading.Lock()
_STATES: dict[str, _State] = {}  # each folder's last claim, released or not: one small entry per folder


@atexit.register
def _release_all() -> None:
    for state in list(_STATES.values()):
        _release(state)


def hold(folder: Location) -> Lease:
    """This process's lease on ``folder``: claimed now if this process holds none, else the one it holds.

    Raises:
        CheckpointWriteError: another live writer holds the folder (the message names its host, pid
            and since when), or the record cannot be read or written.
    """
    key = os.path.realpath(folder.spelled) if not folder.remote else folder.spelled
    record = folder.child(NAME)
    with _HELD_LOCK:
        lease = _HELD.get(key)
        if lease is None or lease.holder.pid != os.getpid():
            if (before := _STATES.get(key)) is not None:
                _release(before)  # a collected lease's release, done before the new claim, not racing it
            try:
                state = _claim(record, folder.spelled)
                lease = Lease(folder.spelled, state)
            except OSError as e:
                if isinstance(e, CkptkitError):
                    raise
                raise CheckpointWriteError(describe_error(e, Path(record.spelled))) from e
            _HELD[key] = lease
            _STATES[key] = state
        return lease


def _claim(record: Location, folder: str) -> _State:
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for _ in range(_CLAIMS):
        mine = _me(os.urandom(8).hex(), since)
        data = mine.encode()
        found = _read(record)
        if found is None:
            if (version := _create(record, data)) is not None:
                return _State(record, mine, version)
            continue
        holder = Holder.decode(found[0], record.spelled)
        if holder.tag == _HOST and holder.pid == os.getpid():  # this process, through a lease since collected
            taken = _renew(record, data, found[1])
        elif not holder.dead():
            raise CheckpointWriteError(
                f"cannot write to {folder}: another writer holds it ({holder.describe()}; its lease in "
                f"{record.spelled} runs until {_clock(holder.expires)}, renewed every {LEASE_S / 4:.0f} s while it "
                "lives); stop that run first, or give this one another folder"
            )
        else:
            taken = _take_over(record, data, found[1])
        if taken is not None:
            return _State(record, mine, taken)
    raise CheckpointWriteError(
        f"cannot write to {folder}: its writer record {record.spelled} changed {_CLAIMS} times while this "
        "process claimed it: other writers are starting there; run one writer per folder"
    )


def _clock(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")
