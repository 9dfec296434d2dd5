"""Object storage: ``s3://`` (or any fsspec URL) wherever a path goes, through a local staging path.

Object stores have no rename, so a URL is never written in place. A file bound for S3 (a
Hugging Face shard too) streams there as it is written (:mod:`.streamed`); anything else (a DCP
folder's files, a file for another store) is written and checked in a staging folder
(``$CKPTKIT_STAGING``, else the system's temp folder), then uploaded in parts (:mod:`.upload`).
Either way the commit is what the store offers (one PUT, or the completion of a multipart upload;
any failure aborts the upload instead, so the previous object stays), checked by the store's
CRC-32 of the object or by reading it back before success is reported. An object on S3, or a
prefix's objects, are read through ranged GETs as the torch-free readers ask for their bytes
(:mod:`.ranged`); what torch reads and other stores are streamed, in ranged GETs, into a staging
file (:func:`staged_read`). Memory stays bounded at any size: a few parts (or pieces of a GET's
stream) in flight.

fsspec (and s3fs for ``s3://``) is imported only when a URL is given: ``pip install 'ckptkit[s3]'``.
Errors raised inside a staged block name the URL, not the staging file.

Example:
    >>> is_url("s3://bucket/run/step_1.pt"), is_url("runs/a/step_1.pt")
    (True, False)
    >>> with staged_read("s3://bucket/ddp.pt") as local:  # doctest: +SKIP
    ...     state = read_checkpoint(local)  # the staging file is removed when the block ends
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..errors import (
    ArgumentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CkptkitError,
    StorageError,
)
from .atomic import remove_stale_temps, temp_path
from .crcmath import crc32_combine
from .fileio import crc32

T = TypeVar("T")

PART_SIZE = 32 << 20  # one upload part, the least a ranged GET asks for (S3's parts are 5 MiB at least)
PARTS_IN_FLIGHT = 4  # parts sent or fetched at once (CKPTKIT_S3_PARTS): memory holds this many parts
RANGE_MAX = 1 << 30  # the most one ranged GET of a download asks for (read as a stream, PIECE at a time)
PIECE = 8 << 20  # what a download's GET is read in: memory holds one piece per GET in flight
_READ_ATTEMPTS = 5  # a ranged GET's stream, dropped, is asked for again from where it stopped (s3fs: 5)

CRC_KEY = "ckptkit-crc32"  # user metadata on objects ckptkit writes: the CRC-32 a later read is held against
_SMALL = 1 << 16  # the most a pointer object may hold
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")
_INSTALL = "pip install 'ckptkit[s3]'"
_STAGE = "ckptkit-stage"  # staging folders are temp folders for this name in $CKPTKIT_STAGING
# A precondition of a conditional request that did not hold (S3: 412; 409 where two raced).
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404"}


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``s3://...``) rather than a local path; a Path never is."""
    return isinstance(path, str) and _URL.match(path) is not None


def as_destination(path: str | os.PathLike[str]) -> Path | str:
    """``path`` as the writers take it: a URL stays a string, anything else becomes a Path."""
    return path if is_url(path) else Path(path)  # type: ignore[return-value]


def name_of(url: str) -> str:
    """The last part of a URL: ``step_1.pt`` of ``s3://b/run/step_1.pt``."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path within it."""
    try:
        import fsspec  # deferred: only URLs need it, and it is an optional extra
    except ImportError:
        raise ArgumentError(
            f"{url}: URLs need fsspec (and s3fs for s3://), which is not installed; {_INSTALL}"
        ) from None
    try:
        return fsspec.core.url_to_fs(url, **_s3_options(url))
    except ImportError as e:  # fsspec knows the protocol, its package (s3fs) is missing
        raise ArgumentError(f"{url}: {e}; for s3:// {_INSTALL}") from None
    except ValueError as e:
        raise ArgumentError(f"{url}: not a URL fsspec can open ({e}); give a local path or an s3:// URL") from None


_RETRY_SETTINGS = ("retry_mode", "max_attempts")
READ_TIMEOUT_S = 60


def _s3_options(url: str) -> dict[str, Any]:
    """s3fs's options for ``url``: botocore's standard retry mode, as the AWS CLI v2 uses, where the
    user configured no retries (``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS``, or the profile's
    ``retry_mode`` / ``max_attempts``). botocore's own default, legacy mode, retries a refused
    connection four times with growing waits: an unreachable endpoint took seconds to name."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    # botocore's (and the AWS CLI's) read timeout, not s3fs's 15 s: completing a multipart upload
    # of a large object can take the store longer, and the retry after a timeout is refused
    config: dict[str, Any] = {"read_timeout": READ_TIMEOUT_S}
    options = {"config_kwargs": config}
    if any(os.environ.get(f"AWS_{k.upper()}") for k in _RETRY_SETTINGS):
        return options
    try:
        import botocore.session

        profile = botocore.session.Session().get_scoped_config()
    except Exception:  # noqa: BLE001 - a profile botocore cannot read: s3fs will say so on first use
        return options
    if any(k in profile for k in _RETRY_SETTINGS):
        return options
    config["retries"] = {"mode": "standard"}
    return options


def _info(fs: Any, key: str, url: str) -> dict[str, Any] | None:
    """The object's listing (size, ETag), or None where nothing is there."""
    try:
        fs.invalidate_cache(key)  # a listing cached before the last write would be stale
        return fs.info(key)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise StorageError(
            f"{url}: the store refused to describe it ({e}); check the URL, credentials and network"
        ) from e


def exists(url: str) -> bool:
    """Whether an object is at ``url``."""
    fs, key = filesystem(url)
    return _info(fs, key, url) is not None


def object_if_any(fs: Any, key: str, url: str) -> dict[str, Any] | None:
    """The listing of the object at ``url``; None where none is there (a prefix, or nothing)."""
    info = _info(fs, key, url)
    return info if info is not None and info.get("type") == "file" else None


def object_info(fs: Any, key: str, url: str) -> dict[str, Any]:
    info = _info(fs, key, url)
    if info is None:
        raise CheckpointNotFoundError(
            f"{url}: no such object; check the bucket and key (list them with `aws s3 ls`)", filename=url
        )
    if info.get("type") != "file":
        raise ArgumentError(
            f"{url} is a prefix with no objects directly under it (a nested layout, such as DeepSpeed's "
            "global_step folders); ckptkit reads an object, or a prefix holding a folder's files: copy this one "
            "to a local path first"
        )
    return info


def recorded_crc(fs: Any, key: str) -> int | None:
    """The CRC-32 ckptkit recorded when it wrote the object, if it did (s3fs only); for an object
    it streamed (its CRC-32 was not known when the upload began), the full-object CRC-32 the
    store computed, where it keeps one."""
    if "s3" not in protocols(fs):
        return None
    try:
        value = fs.metadata(key).get(CRC_KEY)
    except Exception:  # noqa: BLE001 - no recorded CRC is no check, not a failure
        return None
    if value:
        return int(value, 16)
    bucket, path, _ = fs.split_path(key)
    return stored_crc(fs, bucket, path)


def echoed_crc(response: Mapping[str, Any]) -> int | None:
    """The full-object CRC-32 the store says it computed; None where it says none (or a composite one)."""
    value = response.get("ChecksumCRC32")
    if not isinstance(value, str) or response.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def stored_crc(fs: Any, bucket: str, path: str) -> int | None:
    """The full-object CRC-32 the store keeps for the object (HeadObject with ChecksumMode), for
    stores that do not echo it when the upload completes; None where it keeps none."""
    try:
        return echoed_crc(s3_call(fs, "head_object", Bucket=bucket, Key=path, ChecksumMode="ENABLED"))
    except Exception:  # noqa: BLE001 - committed already: a store that will not say is read back, which names its own failure
        return None


def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call through s3fs (its credentials, retries and event loop), from any thread."""
    from fsspec.asyn import sync  # deferred with fsspec, as in filesystem()

    return sync(fs.loop, fs._call_s3, method, **kwargs)


def protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def parts_in_flight() -> int:
    """How many parts an upload sends, or a download fetches, at once: ``$CKPTKIT_S3_PARTS``, else
    :data:`PARTS_IN_FLIGHT`. Memory holds that many parts (of :data:`PART_SIZE` each, or pieces of
    a GET's stream, :data:`PIECE` each) at most.

    Raises:
        ArgumentError: the variable is set to something other than a positive integer.
    """
    given = os.environ.get("CKPTKIT_S3_PARTS", "")
    if not given:
        return PARTS_IN_FLIGHT
    if not given.isdigit() or int(given) < 1:
        raise ArgumentError(f"CKPTKIT_S3_PARTS={given!r}: expected a positive integer (parts sent or fetched at once)")
    return int(given)


def in_flight(work: Callable[[int], T], count: int) -> list[T]:
    """``work(i)`` for i in 0..count-1, :func:`parts_in_flight` at a time on threads; the results
    in order. The first failure (or an interrupt) cancels what has not started and is raised once
    the running ones end."""
    results: dict[int, T] = {}
    n = parts_in_flight()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckptkit-part") as pool:
        pending: dict[concurrent.futures.Future[T], int] = {}
        todo = iter(range(count))
        try:
            while True:
                while len(pending) < n and (i := next(todo, None)) is not None:
                    pending[pool.submit(work, i)] = i
                if not pending:
                    break
                finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    results[pending.pop(future)] = future.result()
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return [results[i] for i in range(count)]


def stream(fs: Any, key: str, url: str, size: int, sink: Any) -> int:
    """CRC-32 of the object's ``size`` bytes, read in ranged GETs, several at once
    (:func:`in_flight`), each written into the file ``sink`` at its offset (None: only counted).

    On S3, each GET covers an equal share of the object (at least :data:`PART_SIZE`, at most
    :data:`RANGE_MAX`) and its body is read as a stream, :data:`PIECE` bytes at a time, so memory
    holds one piece per GET in flight: few requests (some stores, moto among them, read the whole
    object for each ranged GET) without holding a share in memory. Other stores: a GET per part."""
    span = _span(fs, size)

    def fetch(i: int) -> tuple[int, int]:
        at = i * span
        end = min(at + span, size)

        def write(pos: int, piece: bytes) -> None:
            view = memoryview(piece)
            while view:  # pwrite may write less than asked
                view = view[os.pwrite(sink.fileno(), view, pos + len(piece) - len(view)) :]

        return read_range(fs, key, url, at, end, write if sink is not None else None), end - at

    value = 0
    for crc, length in in_flight(fetch, -(-size // span)):
        value = crc32_combine(value, crc, length)
    return value


def read_range(
    fs: Any,
    key: str,
    url: str,
    at: int,
    end: int,
    sink: Callable[[int, bytes], object] | None,
    *,
    etag: str | None = None,
) -> int:
    """CRC-32 of bytes ``at``-``end`` of the object, read in one ranged GET, each piece handed to
    ``sink(offset, piece)`` as it arrives; a dropped stream is asked for again from where it
    stopped. ``etag``: only of that version of the object (S3).

    Raises:
        CheckpointNotFoundError: the object went away; StorageError: the store failed, or the object
            changed (a version other than ``etag``, or fewer bytes than asked for).
    """
    value, pos = 0, at
    for attempt in range(1, _READ_ATTEMPTS + 1):  # a dropped stream resumes where it stopped
        try:
            for piece in _ranged(fs, key, pos, end, etag=etag):
                if pos + len(piece) > end:
                    break  # more than asked for: said below
                if sink is not None:
                    sink(pos, piece)
                value = crc32(piece, value)
                pos += len(piece)
            break
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{url}: the object went away while it was read; read it again", filename=url
            ) from None
        except Exception as e:  # noqa: BLE001 - the store's: OSError, botocore's or aiohttp's own
            if etag is not None and isinstance(e, OSError) and lost_race(e):
                raise StorageError(f"{url}: the object was replaced while it was read; read it again") from None
            if attempt < _READ_ATTEMPTS and store_failure(e):
                continue
            raise StorageError(
                f"{url}: reading bytes {at}-{end} failed at byte {pos} ({one_line(e)}); check the network "
                "and read it again"
            ) from e
    if pos != end:
        raise StorageError(
            f"{url}: asked for bytes {at}-{end}, got {pos - at}: the object changed while it was read; read it again"
        )
    return value


def _span(fs: Any, size: int) -> int:
    """The bytes one ranged GET asks for (:func:`stream`)."""
    if "s3" not in protocols(fs):
        return PART_SIZE  # fsspec's cat_file holds a GET's bytes whole
    return min(max(PART_SIZE, -(-size // parts_in_flight())), RANGE_MAX)


def _ranged(fs: Any, key: str, start: int, end: int, *, etag: str | None = None) -> Iterator[bytes]:
    """Bytes ``start``-``end`` of the object (on S3: only of version ``etag``), in pieces as they arrive."""
    if "s3" not in protocols(fs):
        yield fs.cat_file(key, start=start, end=end)
        return
    from fsspec.asyn import sync  # deferred with fsspec, as in filesystem()

    bucket, path, version = fs.split_path(key)
    got = s3_call(
        fs,
        "get_object",
        Bucket=bucket,
        Key=path,
        Range=f"bytes={start}-{end - 1}",
        **({"VersionId": version} if version else {}),
        **({"IfMatch": etag} if etag else {}),
    )
    body = got["Body"]
    try:
        while piece := sync(fs.loop, body.read, PIECE):
            yield piece
    finally:
        body.close()


def download(url: str, local: Path, *, seen: Mapping[str, Any] | None = None) -> int:
    """Copy the object at ``url`` to the new file ``local``; returns its CRC-32. ``seen``: its
    listing when a read of it began (a prefix's listing): the object must still be that one.

    Raises:
        CheckpointNotFoundError: no object at ``url``.
        CheckpointFormatError: the bytes read differ from the CRC-32 ckptkit recorded on upload.
        StorageError: the store failed, or the object changed while it was read.
    """
    fs, key = filesystem(url)
    info = object_info(fs, key, url)
    with open(local, "xb") as f:
        value = stream(fs, key, url, int(info["size"]), f)
    hold_to_recorded(fs, key, url, value, seen=seen or info)
    return value


def hold_to_recorded(fs: Any, key: str, url: str, value: int, *, seen: Mapping[str, Any]) -> None:
    """Raise unless ``value``, the CRC-32 of every byte of the object as read, is the one recorded
    for it (ckptkit's, or the store's own), where one is. ``seen``: its listing when the read began.

    Raises:
        CheckpointFormatError: they differ; StorageError: the object is no longer the one ``seen``.
    """
    after = _info(fs, key, url) or {}
    same = "ETag" if after.get("ETag") and seen.get("ETag") else "size"  # a listing may give no ETag
    if after.get(same) != seen.get(same):
        raise StorageError(f"{url}: the object was replaced while it was read; read it again")
    recorded = recorded_crc(fs, key)
    if recorded is not None and recorded != value:
        raise CheckpointFormatError(
            f"{url}: its bytes have CRC-32 {value:08x}, but ckptkit recorded {recorded:08x} when it "
            "wrote them: damaged in the store or on the way; read it again, or restore a copy"
        )


@contextlib.contextmanager
def staging(url: str) -> Iterator[Path]:
    """A new staging folder, removed afterwards; yields the file named as the URL's object.

    The folder is named as :mod:`.atomic` names temp files (``.ckptkit-stage.{host}-{pid}-{random}.ckptkit-tmp``),
    so the folders of writers killed on this host (kill -9 runs no cleanup) are removed here, by the next one.
    """
    root = Path(os.environ.get("CKPTKIT_STAGING") or tempfile.gettempdir())
    remove_stale_temps(root / _STAGE)
    folder = temp_path(root / _STAGE)
    try:
        folder.mkdir(mode=0o700)  # as mkdtemp makes it: the staged bytes are the caller's alone
    except OSError as e:
        raise StorageError(
            f"{url}: cannot make a staging folder in {root} ({e}); set CKPTKIT_STAGING to a writable folder"
        ) from e
    try:
        yield folder / (name_of(url) or "object")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def unstaged(text: str, local: Path, url: str) -> str:
    """``text`` naming ``url`` where it named the staging file ``local``."""
    return text.replace(str(local), url)


def renamed(e: CkptkitError, local: Path, url: str) -> CkptkitError:
    """``e`` (changed in place: its class and attributes kept) naming ``url`` where it named ``local``."""
    if e.args and isinstance(e.args[0], str):
        e.args = (unstaged(e.args[0], local, url), *e.args[1:])
    if getattr(e, "filename", None) == str(local):
        e.filename = url  # type: ignore[attr-defined]
    return e


@contextlib.contextmanager
def naming(local: Path, url: str) -> Iterator[None]:
    """Errors raised inside name ``url`` where they would name the staging file."""
    try:
        yield
    except CkptkitError as e:
        raise renamed(e, local, url) from e.__cause__


@contextlib.contextmanager
def staged_read(url: str) -> Iterator[Path]:
    """The object at ``url`` as a local file, for the block's length; a prefix with objects under
    it (a folder written to the store) as a local folder of them.

    Raises:
        CheckpointNotFoundError, StorageError, CheckpointFormatError: as :func:`download`.
    """
    with staging(url) as local, naming(local, url):
        fs, key = filesystem(url)
        info = _info(fs, key, url)
        listed = listing(url) if info is None or info.get("type") != "file" else {}
        if listed:  # a prefix: a folder's files (Hugging Face shards, DCP), each copied and checked
            local.mkdir()
            for name in listed:
                download(join(url, name), local / name)
            if listing(url) != listed:  # a writer replaced files meanwhile: the copy may mix two folders
                raise StorageError(
                    f"{url}/: its objects changed while they were read (a writer at work?); read it again"
                )
        else:
            download(url, local)
        yield local


def join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def list_names(url: str) -> list[str]:
    """Names of the objects directly under the prefix ``url`` (uncompleted uploads are never listed)."""
    return list(listing(url))


def listing(url: str) -> dict[str, tuple[Any, Any]]:
    """The objects directly under the prefix ``url``: name -> (size, ETag)."""
    fs, key = filesystem(url)
    try:
        fs.invalidate_cache(key)
        entries = fs.ls(key, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise StorageError(f"{url}: listing it failed ({e}); check the URL, credentials and network") from e
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: (e.get("size"), e.get("ETag"))
        for e in entries
        if e.get("type") == "file"
    }


def delete(url: str) -> None:
    """Remove the object at ``url`` (nothing there is fine)."""
    fs, key = filesystem(url)
    try:
        fs.rm(key)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise StorageError(f"{url}: deleting it failed ({e}); remove it by hand or check permissions") from e


def read_small(url: str) -> bytes | None:
    """The bytes of a small object (a pointer), or None where there is none."""
    fs, key = filesystem(url)
    info = _info(fs, key, url)
    if info is None or info.get("type") != "file" or int(info["size"]) > _SMALL:
        return None
    try:
        return bytes(fs.cat_file(key))
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise StorageError(f"{url}: reading it failed ({e}); check the network and try again") from e


def one_line(e: BaseException) -> str:
    """``e`` as one line: botocore's messages name the request, some span lines."""
    return " ".join(str(e).split()) or type(e).__name__


def store_failure(e: BaseException) -> bool:
    """Whether ``e`` is the store's or the network's: an OSError, or botocore's and aiohttp's own
    (EndpointConnectionError, NoCredentialsError, ...), which are not OSErrors."""
    return isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def lost_race(e: OSError) -> bool:
    """Whether the store refused a conditional request because its condition did not hold."""
    if isinstance(e, (FileExistsError, FileNotFoundError)):
        return True
    response = getattr(e.__cause__, "response", None) or {}
    return str(response.get("Error", {}).get("Code")) in _LOST_RACE
