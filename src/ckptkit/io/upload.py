"""Writing a URL from a local file: upload a checked file in parts, commit, check the object
(the store's CRC-32 of it, else a read-back). The S3 calls here serve :mod:`.streamed` too.

The commit is what the store offers: one PUT, or the completion of a multipart upload. A
failure or an interrupt before it aborts the upload (fsspec's file would commit what it has
when closed), so a URL shows the previous object or the new one whole, never part of one.
Memory stays bounded: each part in flight is a file over its bytes, read once by the HTTP client
as it sends it. A writer killed mid-upload (kill -9 runs no cleanup code) leaves its multipart
upload open, stored and billed: the next write to that key aborts it (a bucket lifecycle rule,
AbortIncompleteMultipartUpload, removes those of keys that are never written again).

Example:
    >>> with staged_write("s3://bucket/single.pt") as local:  # doctest: +SKIP
    ...     write_checkpoint(state, local)  # uploaded and read back when the block ends
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointWriteError, CkptkitError
from . import remote
from .crcmath import crc32_combine
from .fileio import crc32
from .remote import (
    CRC_KEY,
    echoed_crc,
    filesystem,
    in_flight,
    naming,
    object_info,
    one_line,
    protocols,
    s3_call,
    staging,
    store_failure,
    stored_crc,
    stream,
)

_MAX_PARTS = 9000  # S3 allows 10,000 parts: beyond PART_SIZE * this, parts grow
STORE_CHECK = "the store's CRC-32 of the whole object"
READ_BACK = "reading the object back"


def _file_crc(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(remote.PART_SIZE):
            value = crc32(chunk, value)
    return value


def _abort(out: Any, fs: Any, key: str) -> None:
    """Abandon an upload: abort its multipart upload, so nothing is committed (closing would commit)."""
    try:
        discard = getattr(out, "discard", None)
        if discard is not None:
            discard()
        else:  # a file that writes in place: remove what it wrote
            out.close()
            fs.rm(key)
    except Exception:  # noqa: S110 - the first failure is the one to report; an open multipart upload is invisible
        pass
    finally:
        with contextlib.suppress(Exception):
            out.closed = True  # __del__ would close, and closing commits what was sent


def abort_left_uploads(fs: Any, key: str) -> list[str]:
    """Abort the multipart uploads open for exactly ``key`` before this write starts; their ids.

    Called before this write opens its own, so each is an earlier writer's: one killed mid-upload,
    or one still running, which the write starting now replaces anyway. S3 lists neither an
    upload's metadata nor its tags, so an upload another tool left for a key ckptkit writes is
    aborted too. Only for ``s3://``; best effort (listing needs s3:ListBucketMultipartUploads).
    """
    if "s3" not in protocols(fs):
        return []
    bucket, path, _ = fs.split_path(key)
    aborted: list[str] = []
    marker: dict[str, str] = {}
    try:
        while True:
            found = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=path, **marker)
            for upload in found.get("Uploads", []):
                if upload["Key"] == path:  # the prefix also lists step_1.pt.bak for step_1.pt
                    with contextlib.suppress(FileNotFoundError):  # aborted meanwhile by another writer
                        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=path, UploadId=upload["UploadId"])
                    aborted.append(upload["UploadId"])
            if not found.get("IsTruncated"):
                return aborted
            marker = {"KeyMarker": found["NextKeyMarker"], "UploadIdMarker": found["NextUploadIdMarker"]}
    except Exception as e:  # noqa: BLE001 - cleanup must not fail the write: the write reports a store that is down
        if not store_failure(e):
            raise
        return aborted


def upload_verified(local: Path, url: str) -> str:
    """Upload the file ``local`` to ``url`` in parts, commit, and check what the store holds: by
    the store's own full-object CRC-32 where it computes one (S3 refuses to complete an upload
    whose bytes do not match it), else by reading the object back. Returns which check ran
    (:data:`STORE_CHECK` or :data:`READ_BACK`).

    The object appears only when the whole upload is committed; a failure (or an interrupt)
    before that aborts the multipart upload and leaves any previous object at ``url`` as it was.

    Raises:
        CheckpointWriteError: the upload failed, or what the store holds differs from what was sent.
    """
    fs, key = filesystem(url)
    size = local.stat().st_size
    crc = _file_crc(local)
    part = max(remote.PART_SIZE, -(-size // _MAX_PARTS))
    abort_left_uploads(fs, key)
    with storing(url):
        if "s3" in protocols(fs):
            echoed = _s3_upload(fs, key, local, size=size, crc=crc, part=part)
        else:
            echoed = None
            _fsspec_upload(fs, key, local, crc=crc, part=part, url=url)
    return committed_check(fs, key, url, size=size, crc=crc, echoed=echoed)


@contextlib.contextmanager
def storing(url: str) -> Iterator[None]:
    """The store's failures inside (botocore's are no OSError) as one line naming ``url``, not a traceback."""
    try:
        yield
    except BaseException as e:
        if store_failure(e) and not isinstance(e, CkptkitError):
            raise CheckpointWriteError(
                f"cannot write {url}: {one_line(e)}; the previous object at {url}, if any, is untouched; "
                "check the network, then write it again"
            ) from e
        raise


def committed_check(fs: Any, key: str, url: str, *, size: int, crc: int, echoed: int | None) -> str:
    """After the commit: the CRC-32 the store ``echoed`` held against ``crc``, or (None) the object
    read back; which check ran. An object that differs is removed.

    Raises:
        CheckpointWriteError: what the store holds is not what was sent.
    """
    if echoed is None:
        check_object(url, size=size, crc=crc)
        return READ_BACK
    if echoed != crc:  # a store that completed it anyway: what it holds is not what was sent
        try:
            fs.rm(key)
            removed = "the object was removed"
        except Exception as e:  # noqa: BLE001 - said in the message: the caller must know it is still there
            removed = f"removing the object failed too ({one_line(e)}): delete it"
        raise CheckpointWriteError(
            f"{url}: the store computed CRC-32 {echoed:08x} over the object, but {crc:08x} was sent; "
            f"{removed}; write it again"
        )
    return STORE_CHECK


def _fsspec_upload(fs: Any, key: str, local: Path, *, crc: int, part: int, url: str) -> None:
    """Any fsspec store but S3 (:func:`_s3_upload`): its file object, one part a write, closed to commit."""
    try:
        out = fs.open(key, "wb", block_size=part)
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise CheckpointWriteError(
            f"cannot write {url}: {one_line(e)}; the previous object at {url}, if any, is untouched; "
            "check the bucket, credentials and network"
        ) from e
    try:
        sent = 0
        with open(local, "rb") as f:
            while chunk := f.read(part):  # one part a write: each write uploads a part, none is held longer
                sent = crc32(chunk, sent)
                out.write(chunk)
        if sent != crc:
            raise _changed(local, url=f"{fs.protocol}://{key}")
        out.close()  # the commit: one PUT, or completing the multipart upload
    except BaseException:  # an interrupt too: abort, so no partial object is ever committed
        _abort(out, fs, key)
        raise


def _changed(local: Path, *, url: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"{local} changed while it was uploaded to {url}; the previous object, if any, is untouched; write it again"
    )


def _b64(crc: int) -> str:
    """A CRC-32 as S3 spells it in its checksum headers: the 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _s3_upload(fs: Any, key: str, local: Path, *, size: int, crc: int, part: int) -> int | None:
    """One PUT, or a multipart upload whose parts go several at once, each with its CRC-32 for the
    store to check, completed with the whole object's CRC-32 (``ChecksumType=FULL_OBJECT``), so a
    store that checks refuses bytes that differ. Returns the CRC-32 the store echoed, or None
    where it echoed none (then the caller reads the object back)."""
    bucket, path, _ = fs.split_path(key)
    with open(local, "rb") as f:
        if size <= part:
            data = f.read()
            if crc32(data) != crc:
                raise _changed(local, url=f"s3://{key}")
            return put_one(fs, bucket, path, data, crc)
        upload, checked = create_upload(fs, bucket, path, crc)
        try:
            parts, sent = _send_parts(fs, f.fileno(), upload, size=size, part=part, checked=checked)
            if sent != crc:
                raise _changed(local, url=f"s3://{key}")
            return complete_upload(fs, upload, parts, crc, checked=checked, size=size)
        except BaseException:  # an interrupt too: abort, so no partial object is ever committed
            abort_upload(fs, upload)
            raise


def put_one(fs: Any, bucket: str, path: str, data: bytes, crc: int) -> int | None:
    """The object in one PUT with its CRC-32; the CRC-32 the store echoed or keeps (None: none)."""
    put_object = {"Bucket": bucket, "Key": path, "Body": data, "Metadata": {CRC_KEY: f"{crc:08x}"}}
    try:
        put = s3_call(fs, "put_object", **put_object, ChecksumCRC32=_b64(crc))
    except Exception as e:  # noqa: BLE001 - a store that takes no checksum headers: read back instead
        if not _refused_checksum(e):
            raise
        s3_call(fs, "put_object", **put_object)
        return None
    return echoed if (echoed := echoed_crc(put)) is not None else stored_crc(fs, bucket, path)


def create_upload(fs: Any, bucket: str, path: str, crc: int | None) -> tuple[dict[str, str], bool]:
    """A multipart upload begun, declaring a full-object CRC-32 where the store takes the headers;
    its Bucket/Key/UploadId, and whether checksums were declared. ``crc``: recorded as metadata
    for later reads (None: not known yet, as for a stream; the reads then check nothing more)."""
    meta = {CRC_KEY: f"{crc:08x}"} if crc is not None else {}
    checksum = {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"}
    try:
        created = s3_call(fs, "create_multipart_upload", Bucket=bucket, Key=path, Metadata=meta, **checksum)
    except Exception as e:  # noqa: BLE001 - a store that takes no checksum headers (some S3-compatible ones)
        if not _refused_checksum(e):
            raise
        checksum = {}
        created = s3_call(fs, "create_multipart_upload", Bucket=bucket, Key=path, Metadata=meta)
    return {"Bucket": bucket, "Key": path, "UploadId": created["UploadId"]}, bool(checksum)


def send_part(fs: Any, upload: Mapping[str, str], number: int, body: Any, crc: int, *, checked: bool) -> dict[str, Any]:
    """One part sent (with its CRC-32 where the upload declared checksums); as CompleteMultipartUpload lists it."""
    extra = {"ChecksumCRC32": _b64(crc)} if checked else {}
    r = s3_call(fs, "upload_part", **upload, PartNumber=number, Body=body, **extra)
    return {"PartNumber": number, "ETag": r["ETag"], **extra}


def abort_upload(fs: Any, upload: Mapping[str, str]) -> None:
    """Abandon a multipart upload (best effort: the first failure is the one to report; one left
    open is aborted by the next write to its key)."""
    with contextlib.suppress(Exception):
        s3_call(fs, "abort_multipart_upload", **upload)


def complete_upload(
    fs: Any, upload: Mapping[str, str], parts: list[dict[str, Any]], crc: int, *, checked: bool, size: int
) -> int | None:
    """The commit: the upload completed (with the whole object's CRC-32, where declared); the
    CRC-32 the store echoed or keeps (None: none, or checksums not declared).

    A completion can take the store a while for a large object; if the answer is lost (a read
    timeout, then a retry the store refuses because the first attempt completed it), the object
    is looked at: holding ``size`` bytes with CRC-32 ``crc``, it is this upload's, committed."""
    whole = {"ChecksumCRC32": _b64(crc), "ChecksumType": "FULL_OBJECT"} if checked else {}
    try:
        done = s3_call(fs, "complete_multipart_upload", **upload, MultipartUpload={"Parts": parts}, **whole)
    except Exception:
        if not _holds(fs, f"{upload['Bucket']}/{upload['Key']}", size=size, crc=crc):
            raise
        abort_upload(fs, upload)  # completed: the store answers NoSuchUpload; refused: not left open
        return stored_crc(fs, upload["Bucket"], upload["Key"])  # None: the caller reads it back, and says so
    if not checked:
        return None
    return echoed if (echoed := echoed_crc(done)) is not None else stored_crc(fs, upload["Bucket"], upload["Key"])


def _holds(fs: Any, key: str, *, size: int, crc: int) -> bool:
    """Whether the object at ``key`` has ``size`` bytes with CRC-32 ``crc`` (by the store's
    CRC-32 where it keeps one, else by reading it); False where it cannot be told."""
    try:
        fs.invalidate_cache(key)
        if int(fs.info(key)["size"]) != size:
            return False
        bucket, path, _ = fs.split_path(key)
        kept = stored_crc(fs, bucket, path)
        return (kept if kept is not None else stream(fs, key, f"s3://{key}", size, None)) == crc
    except Exception:  # noqa: BLE001 - not there, or the store still failing: not committed, as far as is known
        return False


def _refused_checksum(e: BaseException) -> bool:
    """Whether a store refused the checksum headers themselves (not the bucket, nor the credentials)."""
    text = str(e)
    return any(k in text for k in ("ChecksumType", "ChecksumAlgorithm", "x-amz-checksum", "NotImplemented"))


def _send_parts(
    fs: Any, fd: int, upload: Mapping[str, str], *, size: int, part: int, checked: bool
) -> tuple[list[dict[str, Any]], int]:
    """Upload ``fd``'s bytes as parts of ``part`` bytes, several at once (:func:`~.remote.in_flight`);
    returns the parts as CompleteMultipartUpload lists them, and the CRC-32 of the bytes sent."""

    def send(i: int) -> tuple[dict[str, Any], int, int]:
        body = _Range(fd, i * part, min(part, size - i * part))
        value = 0
        while chunk := body.read(_CRC_STEP):
            value = crc32(chunk, value)
        body.seek(0)
        return send_part(fs, upload, i + 1, body, value, checked=checked), value, body.length

    sent = in_flight(send, -(-size // part))
    value = 0
    for _, crc, length in sent:
        value = crc32_combine(value, crc, length)
    return [listed for listed, _, _ in sent], value


_CRC_STEP = 1 << 20


class _Range(io.RawIOBase):
    """``length`` bytes of ``fd`` from ``start``, as a seekable file: a part's body. The HTTP
    client reads a body it is given into memory once; given the part's bytes, it held a copy
    beside them, two parts' worth per part in flight."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = self._read_at(self.start + self.pos, n) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def _read_at(self, at: int, n: int) -> bytes | memoryview:
        return os.pread(self.fd, n, at)


class PartBody(_Range):
    """A part's bytes held in memory, as a file the HTTP client reads a piece at a time: given the
    bytes (or a BytesIO, whose buffer aiohttp takes), it made a whole copy of them for the send."""

    def __init__(self, data: bytes | bytearray) -> None:
        super().__init__(-1, 0, len(data))
        self.data = memoryview(data)

    def _read_at(self, at: int, n: int) -> bytes | memoryview:
        return self.data[at : at + n]


def check_object(url: str, *, size: int, crc: int) -> None:
    """Read the object at ``url`` back; raise unless it has ``size`` bytes with CRC-32 ``crc``.

    Raises:
        CheckpointWriteError: it differs (then it is removed) or cannot be read.
    """
    fs, key = filesystem(url)
    try:
        info = object_info(fs, key, url)
        found_size = int(info["size"])
        found = stream(fs, key, url, found_size, None) if found_size == size else None
    except CkptkitError as e:
        raise CheckpointWriteError(f"{url}: uploaded, but reading it back failed: {e}") from e
    if found_size != size or found != crc:
        with contextlib.suppress(Exception):
            fs.rm(key)
        got = f"{found_size} bytes" + (f", CRC-32 {found:08x}" if found is not None else "")
        raise CheckpointWriteError(
            f"{url}: read back {got}, but {size} bytes with CRC-32 {crc:08x} were written; "
            "the object was removed; write it again"
        )


@contextlib.contextmanager
def staged_write(url: str, checked: list[str] | None = None) -> Iterator[Path]:
    """A local path to write; when the block ends without error, it is uploaded to ``url`` and
    checked (:func:`upload_verified`; which check ran is appended to ``checked``). On error
    nothing is uploaded."""
    filesystem(url)  # a missing extra fails before anything is written
    with staging(url) as local, naming(local, url):
        yield local
        how = upload_verified(local, url)
        if checked is not None:
            checked.append(how)


def upload_folder(
    local: Path, url: str, *, published_by: Callable[[str], bool], sent: Collection[str] = ()
) -> list[str]:
    """Upload each file of the folder ``local`` under the prefix ``url`` (:func:`upload_verified`),
    the files ``published_by`` names (an index, DCP's ``.metadata``) last, once every other file is
    committed and checked: a reader never finds one naming a file that is missing or partial. An
    earlier such file under ``url`` is removed first, so the files it named are never seen changing
    under it; once the new one is in place, the earlier files the new folder did not replace are
    removed too (those of the kinds it writes, by suffix; other objects stay). Returns the check
    each upload passed. ``sent``: files already committed under ``url`` (streamed), not uploaded.

    Raises:
        CheckpointWriteError: as :func:`upload_verified`; the folder is then left unpublished.
    """
    names = sorted((p.name for p in local.iterdir() if p.is_file()), key=lambda n: (published_by(n), n))
    earlier = remote.list_names(url)
    for old in earlier:
        if published_by(old):
            remote.delete(remote.join(url, old))
    checks = []
    for name in names:
        if name in sent:
            continue
        try:
            checks.append(upload_verified(local / name, remote.join(url, name)))
        except CheckpointWriteError as e:
            raise CheckpointWriteError(
                f"{url}/: {e} (the folder is unpublished: no index is there until it is written again)"
            ) from e
    kinds = {Path(n).suffix for n in names}
    for old in earlier:
        if old not in names and Path(old).suffix in kinds and not published_by(old):
            remote.delete(remote.join(url, old))
    return checks


def write_small(url: str, data: bytes) -> None:
    """Write a small object in one PUT, and read it back.

    Raises:
        CheckpointWriteError: the PUT failed or what was read back differs.
    """
    fs, key = filesystem(url)
    try:
        fs.pipe_file(key, data)
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise CheckpointWriteError(
            f"cannot write {url}: {one_line(e)}; the previous object, if any, is untouched"
        ) from e
    check_object(url, size=len(data), crc=crc32(data))
