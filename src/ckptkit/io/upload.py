"""Writing a URL: upload a checked local file in parts, commit, read the object back.

The commit is what the store offers: one PUT, or the completion of a multipart upload. A
failure or an interrupt before it aborts the upload (fsspec's file would commit what it has
when closed), so a URL shows the previous object or the new one whole, never part of one.
Memory stays bounded: one part is held at a time. A writer killed mid-upload (kill -9 runs no
cleanup code) leaves its multipart upload open, stored and billed: the next write to that key
aborts it (a bucket lifecycle rule, AbortIncompleteMultipartUpload, removes those of keys that are
never written again).

Example:
    >>> with staged_write("s3://bucket/single.pt") as local:  # doctest: +SKIP
    ...     write_checkpoint(state, local)  # uploaded and read back when the block ends
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CheckpointWriteError, CkptkitError
from . import remote
from .fileio import crc32
from .remote import CRC_KEY, filesystem, naming, object_info, one_line, protocols, staging, store_failure, stream

_MAX_PARTS = 9000  # S3 allows 10,000 parts: beyond PART_SIZE * this, parts grow


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


def upload_verified(local: Path, url: str) -> None:
    """Upload the file ``local`` to ``url`` in parts, commit, and read the object back.

    The object appears only when the whole upload is committed; a failure (or an interrupt)
    before that aborts the multipart upload and leaves any previous object at ``url`` as it was.

    Raises:
        CheckpointWriteError: the upload failed, or what was read back differs from what was sent.
    """
    fs, key = filesystem(url)
    size = local.stat().st_size
    crc = _file_crc(local)
    part = max(remote.PART_SIZE, -(-size // _MAX_PARTS))
    extra = {"Metadata": {CRC_KEY: f"{crc:08x}"}} if "s3" in protocols(fs) else {}
    untouched = f"the previous object at {url}, if any, is untouched"
    abort_left_uploads(fs, key)
    try:
        out = fs.open(key, "wb", block_size=part, **extra)
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise CheckpointWriteError(
            f"cannot write {url}: {one_line(e)}; {untouched}; check the bucket, credentials and network"
        ) from e
    try:
        sent = 0
        with open(local, "rb") as f:
            while chunk := f.read(part):  # one part a write: each write uploads a part, none is held longer
                sent = crc32(chunk, sent)
                out.write(chunk)
        if sent != crc:
            raise CheckpointWriteError(f"{local} changed while it was uploaded to {url}; {untouched}; write it again")
        out.close()  # the commit: one PUT, or completing the multipart upload
    except BaseException as e:  # an interrupt too: abort, so no partial object is ever committed
        _abort(out, fs, key)
        if store_failure(e) and not isinstance(e, CkptkitError):  # botocore's are no OSError: one line, not a traceback
            raise CheckpointWriteError(
                f"cannot write {url}: {one_line(e)}; {untouched}; check the network, then write it again"
            ) from e
        raise
    check_object(url, size=size, crc=crc)


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
def staged_write(url: str) -> Iterator[Path]:
    """A local path to write; when the block ends without error, it is uploaded to ``url`` and
    read back (:func:`upload_verified`). On error nothing is uploaded."""
    filesystem(url)  # a missing extra fails before anything is written
    with staging(url) as local, naming(local, url):
        yield local
        upload_verified(local, url)


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
