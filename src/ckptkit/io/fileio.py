"""File primitives every format shares: opening a checkpoint's files (regular files only), bounded
reads, checked copies (the kernel's: :mod:`.kcopy`), CRC-32.

The CRC-32 function lives here alone, so every reader and writer checks bytes the same way.
It is ISA-L's (the ``isal`` package, ~6x ``zlib.crc32`` on x86-64 with PCLMUL; BENCHMARKS.md),
and ``zlib``'s where no ``isal`` wheel exists (pyproject.toml's markers): the same polynomial,
the same values.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from ..errors import PARSE_ERRORS, CheckpointFormatError, CheckpointNotFoundError
from .helper import in_background
from .kcopy import NoKernelCopy, copy_file_range, start_writeback

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an isal wheel: zlib's, several times slower
    from zlib import crc32 as _crc32

_CHUNK = 64 << 20  # a plain copy's step, and how much is copied between writeback starts
_CHECKED_STEP = 32 << 20  # a checked copy's step: the copy and its CRC read the same bytes at once
_PYTHON_STEP = 8 << 20  # a copy to a sink without a descriptor (a cast, a stream to a store): held in memory
# Smaller writes are left to the closing fsync: the kernel would start writing them back alone,
# and a syscall each (a file of many small tensors) costs more than their head start saves.
_WRITEBACK_FROM = 256 << 10
_MAPPED_FROM = 2 << 20  # shorter ranges are CRC'd from a read: a mapping and a thread cost more than they save
Progress = Callable[[int], None]
T = TypeVar("T")


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 (the zip polynomial) of ``data``, continuing from ``value``.

    Example:
        >>> hex(crc32(b"123456789"))
        '0xcbf43926'
    """
    return _crc32(data, value)


_KINDS = (  # what may sit where a file was expected, as messages name it
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


# Paths standing for an object read elsewhere (io.store: a URL's object read through ranged GETs,
# io.ranged): open_regular opens the object instead, and local_file fetches it whole into the
# path first. (opener, fill) by absolute path.
_ELSEWHERE: dict[str, tuple[Callable[[], BinaryIO], Callable[[], None]]] = {}


@contextlib.contextmanager
def routed(table: dict[str, T], path: str | os.PathLike[str], value: T) -> Iterator[None]:
    """Within the block, ``table`` maps ``path`` (made absolute) to ``value``: where a path's reads
    or writes go instead (:func:`read_elsewhere`, :func:`~.atomic.written_elsewhere`)."""
    key = os.path.abspath(path)
    table[key] = value
    try:
        yield
    finally:
        table.pop(key, None)


def read_elsewhere(
    path: str | os.PathLike[str], opener: Callable[[], BinaryIO], fill: Callable[[], None]
) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`open_regular` of ``path`` gives ``opener()``'s file, and
    :func:`local_file` first runs ``fill()``, which makes ``path`` a local copy of it."""
    return routed(_ELSEWHERE, path, (opener, fill))


def local_file(path: str | os.PathLike[str]) -> str:
    """``path`` as a file a reader that opens paths itself (torch, the safetensors package) can open:
    where it stands for an object read elsewhere (:func:`read_elsewhere`), the object is copied
    into it whole first (from then on it is read locally). A folder: every such file under it.

    Example:
        >>> local_file("model.safetensors")
        'model.safetensors'
    """
    where = os.path.abspath(path)
    keys = list(_ELSEWHERE)  # one atomic copy: other threads' reads register and drop theirs
    for key in [k for k in keys if k == where or k.startswith(where + os.sep)]:
        found = _ELSEWHERE.pop(key, None)  # taken first: another thread's call does not fill it twice
        if found is not None:
            try:
                found[1]()
            except BaseException:
                _ELSEWHERE.setdefault(key, found)  # not filled: its reads still go to the object, not to a hole
                raise
    return os.fspath(path)


def _descriptor(f: BinaryIO) -> int:
    """``f``'s file descriptor; -1 for an object in a store (:mod:`.ranged`) or a sink that is no file."""
    try:
        return f.fileno()
    except (io.UnsupportedOperation, AttributeError):  # AttributeError: a sink that is no file (a cast)
        return -1


def file_size(f: BinaryIO) -> int:
    """The size of the open file ``f`` (a local file, or an object read elsewhere)."""
    fd = _descriptor(f)
    if fd >= 0:
        return os.fstat(fd).st_size
    pos = f.tell()
    end = f.seek(0, os.SEEK_END)
    f.seek(pos)
    return end


def pread(f: BinaryIO, length: int, offset: int) -> bytes:
    """``length`` bytes of the open file ``f`` from ``offset`` (fewer at its end); its position is
    unmoved where it has a descriptor (``os.pread``), restored where it has none."""
    fd = _descriptor(f)
    if fd >= 0:
        return os.pread(fd, length, offset)
    pos = f.tell()
    f.seek(offset)
    data = f.read(length)
    f.seek(pos)
    return data


_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16  # buffers per preadv


def pread_into(f: BinaryIO, buffers: list[memoryview], offset: int) -> int:
    """Fill ``buffers`` in turn with the bytes of the open file ``f`` from ``offset``; returns how
    many bytes were read (fewer only at its end). A local file is read by ``preadv`` straight into
    them (a band's rows from a chunk's: no copy between); an object in a store is read in one
    run (one ranged read, not one per buffer), then copied in.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"abcdef")
        ...     f.flush()
        ...     out = bytearray(4)
        ...     pread_into(f, [memoryview(out)[2:], memoryview(out)[:2]], 1), bytes(out)
        (4, b'debc')
    """
    fd = _descriptor(f)
    done = 0
    if fd >= 0 and hasattr(os, "preadv"):
        for at in range(0, len(buffers), _IOV_MAX):
            batch = buffers[at : at + _IOV_MAX]
            want = sum(map(len, batch))
            got = os.preadv(fd, batch, offset + done)
            done += got
            if got < want:  # its end, or a short read: the rest read as pread reads it
                return done + _copy_into(f, _after(buffers[at:], got), offset + done)
        return done
    return _copy_into(f, buffers, offset)


def _after(buffers: list[memoryview], n: int) -> list[memoryview]:
    """What of ``buffers`` is left once ``n`` bytes have filled them."""
    for i, b in enumerate(buffers):
        if n < len(b):
            return [b[n:], *buffers[i + 1 :]]
        n -= len(b)
    return []


def _copy_into(f: BinaryIO, buffers: list[memoryview], offset: int) -> int:
    """The buffers' whole span read as one run (looping on short reads), then copied into them."""
    want = sum(len(b) for b in buffers)
    data = bytearray()
    while len(data) < want:
        more = pread(f, want - len(data), offset + len(data))
        if not more:  # its end
            break
        data += more
    done = 0
    for b in buffers:
        n = min(len(b), len(data) - done)
        b[:n] = data[done : done + n]
        done += n
    return done


def open_regular(path: str | os.PathLike[str], *, folder: str | os.PathLike[str] | None = None) -> BinaryIO:
    """Open ``path`` for reading where it is a regular file, or a symlink to one (the Hugging Face
    cache links every file); else raise, saying what is there instead.

    Every file a checkpoint folder names is opened here. What sits under such a name may be
    anything: a plain ``open`` of a FIFO waits for a writer that never comes, ``/dev/zero`` reads
    without end, a folder or a symlink loop raises a bare OSError. So nothing but a regular file
    is opened as one: a device is refused from ``stat`` before it is opened (opening one may act),
    the open does not block (a FIFO opens at once), and what was opened is judged again by
    ``fstat``, so a file swapped in meanwhile is judged too. The file is handed back blocking.

    Args:
        path: the file.
        folder: the checkpoint folder whose file it is (the fix then names it); None for a path
            given as the checkpoint itself.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        CheckpointFormatError: a folder, FIFO, device or socket is there, or a symlink that leads
            nowhere (a loop, a missing target), or a file this user may not read.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as t, open_regular(t.name) as f:
        ...     f.read()
        b''
        >>> open_regular("/dev/null")
        Traceback (most recent call last):
        ckptkit.errors.CheckpointFormatError: /dev/null: is a character device, not a regular file; give a checkpoint file (copy what it holds to a file first)
    """
    elsewhere = _ELSEWHERE.get(os.path.abspath(path))
    if elsewhere is not None:
        return elsewhere[0]()
    require_regular(path, folder=folder)  # a device is never opened: opening one may act
    try:
        f = open(path, "rb", opener=_nonblocking)  # noqa: SIM115 - the caller's to close
    except OSError as e:
        raise _refusal(path, e, folder) from e
    try:
        _refuse_unless_regular(path, os.fstat(f.fileno()), folder)
        os.set_blocking(f.fileno(), True)  # a regular file reads alike either way; its users expect blocking
    except BaseException:
        f.close()
        raise
    return f


def require_regular(path: str | os.PathLike[str], *, folder: str | os.PathLike[str] | None = None) -> None:
    """Raise as :func:`open_regular` does unless ``path`` is a regular file (or a symlink to one);
    nothing is opened: for a check of a folder's files before any is read.

    Example:
        >>> require_regular("/dev/null", folder="/dev")
        Traceback (most recent call last):
        ckptkit.errors.CheckpointFormatError: /dev/null: is a character device, not a regular file; restore the file the writer saved there from a complete copy of /dev
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise _refusal(path, e, folder) from e
    _refuse_unless_regular(path, st, folder)


def small_json(path: str | os.PathLike[str], *, limit: int) -> Any:
    """The JSON value in a small file beside a checkpoint (a config, an index of modules), or None
    where there is none, it is not a regular file, holds over ``limit`` bytes or is not JSON: such
    a file is described or ignored, never trusted.

    Example:
        >>> small_json("/no/such/config.json", limit=1000) is None
        True
    """
    try:
        with open_regular(path, folder=os.path.dirname(path) or ".") as f:
            if file_size(f) > limit:
                return None
            return json.loads(f.read().decode("utf-8"))
    except PARSE_ERRORS:  # ckptkit's refusals too: each is a ValueError or an OSError
        return None


def _nonblocking(path: str, flags: int) -> int:
    # O_NOCTTY: a terminal swapped in after the stat check must not become this process's own
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))


def _refuse_unless_regular(
    path: str | os.PathLike[str], st: os.stat_result, folder: str | os.PathLike[str] | None
) -> None:
    if not stat.S_ISREG(st.st_mode):
        found = next((kind for test, kind in _KINDS if test(st.st_mode)), f"file type {stat.S_IFMT(st.st_mode):o}")
        raise CheckpointFormatError(f"{path}: is {found}, not a regular file; {_fix(folder)}")


def _refusal(path: str | os.PathLike[str], e: OSError, folder: str | os.PathLike[str] | None) -> Exception:
    """The ckptkit error for an OSError from stat or open of ``path``; ``e`` itself where the
    system, not the path, failed (out of descriptors, an I/O error)."""
    if e.errno == errno.ENOENT and os.path.islink(path):
        found = f"a dangling symlink (to {_target(path)!r}, which does not exist)"
    elif e.errno == errno.ELOOP:
        found = "a symlink loop (or a chain of over 40 symlinks)"
    elif e.errno == errno.EISDIR:  # a folder swapped in between the stat and the open
        found = "a folder"
    elif e.errno in (errno.EACCES, errno.EPERM):
        return CheckpointFormatError(
            f"{path}: cannot be read (permission denied); give the user running ckptkit read access to it "
            "and to its folders"
        )
    elif e.errno in (errno.ENOENT, errno.ENOTDIR):
        fix = "" if folder is None else f"; {_fix(folder)}"
        return CheckpointNotFoundError(f"{path}: no such file{fix}", filename=os.fspath(path))
    elif e.errno == errno.ENXIO:  # a socket, or a device without its driver
        found = "a socket or device"
    else:
        return e
    return CheckpointFormatError(f"{path}: is {found}, not a regular file; {_fix(folder)}")


def _target(link: str | os.PathLike[str]) -> str:
    try:
        return os.readlink(link)
    except OSError:  # replaced since: its name is all the message needs
        return "?"


def _fix(folder: str | os.PathLike[str] | None) -> str:
    if folder is None:
        return "give a checkpoint file (copy what it holds to a file first)"
    return f"restore the file the writer saved there from a complete copy of {folder}"


class ClampedReader:
    """A read-only file view whose reads never ask for more than is left.

    ``file.read(n)`` allocates ``n`` bytes before reading, so a pickle length field flipped to
    2**40 would ask for a terabyte; every pickle read from a file goes through this instead.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._end = file_size(f)

    def _left(self, n: int | None) -> int:
        left = max(0, self._end - self._f.tell())
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: int | None = -1) -> bytes:
        return self._f.read(self._left(n))

    def readline(self, limit: int | None = -1) -> bytes:
        return self._f.readline(self._left(limit))

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf)
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)


def copy_range(
    src: BinaryIO,
    dst: BinaryIO,
    offset: int,
    length: int,
    progress: Progress | None = None,
    *,
    crc: bool = False,
) -> int:
    """Append ``length`` bytes of ``src`` from ``offset`` to ``dst``, in the kernel when it can.

    With ``crc``, returns the CRC-32 of the source bytes as they are copied (else 0), for the
    caller to hold against the CRC the source records: while the kernel copies each step
    (``copy_file_range``), a second thread CRCs the same bytes from a read-only mapping of the
    source, so checking costs little more than the copy and nothing is copied into Python.

    A ``dst`` without a file descriptor (``fileno`` raises: ``convert --dtype``'s sink, which casts
    each piece as it comes, or a stream to a store), or a ``src`` without one (an object read from a
    store), is copied through Python, in steps of at most 8 MiB.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as s, tempfile.TemporaryFile() as d:
        ...     _ = s.write(b"123456789")
        ...     s.flush()
        ...     hex(copy_range(s, d, 0, 9, crc=True))
        '0xcbf43926'
    """
    dst.flush()
    try:
        out = dst.fileno()
    except (AttributeError, OSError):  # a sink that is no file (a cast converts each piece): read and written in Python
        out = -1
    inp = _descriptor(src)  # none: an object in a store, read through Python
    written_at = os.lseek(out, 0, os.SEEK_CUR) if out >= 0 else 0
    value = done = started = 0
    use_kernel = out >= 0 and inp >= 0 and hasattr(os, "copy_file_range")
    mapped = crc and use_kernel and length >= _MAPPED_FROM  # each step's mapping is checked against the file's end
    while done < length:
        step = (
            min(_CHECKED_STEP if crc else _CHUNK, length - done)
            if min(out, inp) >= 0
            else min(_PYTHON_STEP, length - done)
        )
        n = 0
        if use_kernel:
            try:
                n, value = _kernel_copy(inp, out, step, offset + done, value if crc else None, mapped)
            except NoKernelCopy:  # cross-device on old kernels, or a filesystem without support
                use_kernel = False
        if not use_kernel:
            src.seek(offset + done)
            chunk = src.read(step)
            dst.write(chunk)
            dst.flush()
            n = len(chunk)
            value = _crc32(chunk, value) if crc else 0
        if n <= 0:
            raise CheckpointFormatError(f"{getattr(src, 'name', 'source')}: ended early at byte {offset + done}")
        done += n
        if out >= 0 and (done - started >= _CHUNK or done == length):
            start_writeback(out, written_at + started, done - started)
            started = done
        if progress is not None:
            progress(n)
    return value


def _kernel_copy(inp: int, out: int, step: int, at: int, value: int | None, mapped: bool) -> tuple[int, int]:
    """The kernel's copy of up to ``step`` bytes of ``inp`` at ``at`` to ``out``: ``(bytes copied,
    CRC-32 continued from value)``; no CRC (0) where ``value`` is None."""
    if value is None:
        return copy_file_range(inp, out, step, at), 0
    if not mapped:  # a short range: read back what was copied, from warm pages
        n = copy_file_range(inp, out, step, at)
        return n, _crc32(os.pread(inp, n, at), value) if n > 0 else value
    # On another core, while the kernel copies the same bytes: that thread maps, CRCs and
    # unmaps its step, so the page-table work of the mapping stays off this thread.
    crc = in_background(_crc_of_mapped, inp, at, step, value)
    try:
        n = copy_file_range(inp, out, step, at)
    finally:  # waited for whatever fails: it reads the file the caller closes next
        stepped = crc()
    if n == step:
        return n, stepped
    return n, _crc_of_mapped(inp, at, n, value) if n > 0 else value  # a short copy: CRC what was copied


def crc_in_background(f: BinaryIO, offset: int, length: int) -> Callable[[], int] | None:
    """The CRC-32 of ``length`` bytes of the local file ``f`` from ``offset``, computed on a
    helper thread while the caller reads the same bytes elsewhere (through the same page cache);
    returns the function that waits for it. None for an object in a store (a second read would
    fetch it twice): the caller CRCs what it read.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"xx123456789")
        ...     f.flush()
        ...     hex(crc_in_background(f, 2, 9)())
        '0xcbf43926'
    """
    fd = _descriptor(f)
    return None if fd < 0 else in_background(_crc_of_mapped, fd, offset, length, 0)


def _crc_of_mapped(fd: int, at: int, n: int, value: int) -> int:
    """CRC-32 of ``n`` bytes of the file at ``at`` through a read-only mapping (read where the
    file cannot be mapped), continued from ``value``."""
    with _mapped(fd, at, n) as view:
        if view is None:
            return _crc32(os.pread(fd, n, at), value)
        whole, first = view
        with whole[at - first : at - first + n] as part:
            return _crc32(part, value)


_View = tuple[memoryview, int]


@contextlib.contextmanager
def _mapped(fd: int, offset: int, length: int, *, populate: bool = False) -> Iterator[_View | None]:
    """``(view, first)``: a read-only view of the file from byte ``first`` (<= ``offset``), or
    None where a range is short or the file cannot be mapped (then reads are used).

    ``populate``: map every page up front (MAP_POPULATE, Linux), ~10% faster for one pass over
    warm pages than a fault per page; for a reader that goes through all of it anyway (verify),
    not for a copy that should start before the whole range is read.

    Only bytes inside the file are mapped. A source truncated in place while it is copied would
    make a read through the view fault (SIGBUS); ckptkit's writers replace files atomically (a new
    inode), which leaves an open source as it was.
    """
    if length < _MAPPED_FROM or offset + length > os.fstat(fd).st_size:  # past the end: mapped reads would SIGBUS
        yield None
        return
    first = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        m = mmap.mmap(fd, offset + length - first, flags=flags, prot=mmap.PROT_READ, offset=first)
    except (OSError, ValueError, TypeError):  # a pipe, a filesystem that cannot map, or no flags= (Windows)
        yield None
        return
    view = memoryview(m)
    try:
        yield view, first
    finally:
        view.release()
        m.close()


def write_checked(dst: BinaryIO, buf: Any, progress: Progress | None = None, *, writeback: bool = False) -> int:
    """Write ``buf`` (any buffer) to ``dst``; returns its CRC-32, computed on the CRC thread
    while each step is written, so a save pays for the write, not for the write and the CRC.
    ``writeback``: a file's writeback of a buffer of :data:`_WRITEBACK_FROM` bytes or more starts
    as soon as it is written (:func:`.kcopy.start_writeback`), as :func:`copy_range`'s does; for a
    caller writing a long run in steps (a DCP tensor's bands), where it was measured to pay. A
    save's large storages, written whole, were slower with it.

    Example:
        >>> import io
        >>> hex(write_checked(io.BytesIO(), b"123456789"))
        '0xcbf43926'
    """
    value = 0
    with memoryview(buf) as whole, whole.cast("B") as data:
        out = _descriptor(dst) if writeback and len(data) >= _WRITEBACK_FROM else -1
        start = dst.tell() if out >= 0 else 0
        for at in range(0, len(data), _CHECKED_STEP):
            with data[at : at + _CHECKED_STEP] as part:
                crc = in_background(_crc32, part, value)
                try:
                    dst.write(part)
                finally:
                    value = crc()  # the thread reads the buffer: it must finish before the view goes
                if out >= 0:
                    start_writeback(out, start + at, len(part))
                if progress is not None:
                    progress(len(part))
    return value


def crc_of_range(src: BinaryIO, offset: int, length: int, progress: Progress | None = None) -> int:
    """CRC-32 of a byte range (``progress(n)`` after each step), read through a read-only mapping
    where it is long enough (no copy into Python: verify runs at memory speed), else in bounded
    chunks.

    Example:
        >>> import io, tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"xx123456789")
        ...     hex(crc_of_range(f, 2, 9))
        '0xcbf43926'
    """
    crc = 0
    fd = _descriptor(src)  # none: an object in a store, read in chunks
    with _mapped(fd, offset, length, populate=True) if fd >= 0 else contextlib.nullcontext(None) as view:
        if view is not None:
            whole, first = view
            for at in range(offset - first, offset - first + length, _CHECKED_STEP):
                with whole[at : min(at + _CHECKED_STEP, offset - first + length)] as part:
                    crc = _crc32(part, crc)
                    if progress is not None:
                        progress(len(part))
            return crc
    src.seek(offset)
    left = length
    while left:
        chunk = src.read(min(8 << 20, left))  # small chunks: verify keeps little memory
        if not chunk:
            raise CheckpointFormatError(
                f"{getattr(src, 'name', 'source')}: ended early at byte {offset + length - left}"
            )
        crc = _crc32(chunk, crc)
        left -= len(chunk)
        if progress is not None:
            progress(len(chunk))
    return crc
