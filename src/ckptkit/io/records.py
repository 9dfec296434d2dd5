"""Small records in a store written conditionally: a folder's writer lease (:mod:`.lease`) is one.

On S3 the condition is the store's own (``If-Match``, ``If-None-Match: *``), so two writers never
both succeed; other fsspec stores are read and then written, which narrows a race but does not
close it.

Example:
    >>> version = put_record("s3://bucket/run/.writer", b"host-1", if_match=None)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ..errors import StorageError
from .remote import filesystem, lost_race, one_line, protocols


async def _get(fs: Any, bucket: str, key: str) -> tuple[bytes, str]:
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    async with response["Body"] as body:
        return bytes(await body.read()), str(response["ETag"])


def read_record(url: str) -> tuple[bytes, str] | None:
    """The bytes of a small object and their version (its ETag), or None where there is none.

    Raises:
        StorageError: the store failed.
    """
    fs, key = filesystem(url)
    try:
        if "s3" in protocols(fs):
            from fsspec.asyn import sync  # deferred with fsspec: the ETag and the bytes of one GET

            bucket, path, _ = fs.split_path(key)
            return sync(fs.loop, _get, fs, bucket, path)
        fs.invalidate_cache(key)
        data = bytes(fs.cat_file(key))
        return data, data.decode(errors="replace")
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        raise StorageError(f"{url}: reading it failed ({one_line(e)}); check the network and try again") from e


def put_record(url: str, data: bytes, *, if_match: str | None) -> str | None:
    """Write a small object only if it is still version ``if_match`` (None: only if there is none).

    Returns its new version, or None where the condition did not hold. On S3 the condition is the
    store's (``If-Match``, ``If-None-Match: *``), so two writers never both succeed; other fsspec
    stores are read and then written, which narrows a race but does not close it.

    Raises:
        StorageError: the store failed.
    """
    fs, key = filesystem(url)
    try:
        if "s3" in protocols(fs):
            bucket, path, _ = fs.split_path(key)
            condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
            done = fs.call_s3("put_object", Bucket=bucket, Key=path, Body=data, **condition)
            fs.invalidate_cache(key)
            return str(done["ETag"])
        found = read_record(url)
        if (found[1] if found else None) != if_match:
            return None
        fs.pipe_file(key, data)
        return data.decode(errors="replace")
    except OSError as e:
        if lost_race(e):
            return None
        raise StorageError(f"{url}: writing it failed ({one_line(e)}); check the network and permissions") from e
    except Exception as e:  # noqa: BLE001 - botocore's own (no credentials, endpoint gone)
        raise StorageError(f"{url}: writing it failed ({one_line(e)}); check the network and credentials") from e


def delete_record(url: str, version: str) -> None:
    """Remove a small object if it is still ``version`` (another writer's is left alone).

    Raises:
        StorageError: the store failed.
    """
    fs, key = filesystem(url)
    try:
        if "s3" in protocols(fs):
            bucket, path, _ = fs.split_path(key)
            fs.call_s3("delete_object", Bucket=bucket, Key=path, IfMatch=version)
            fs.invalidate_cache(key)
            return
        found = read_record(url)
        if found is not None and found[1] == version:
            fs.rm(key)
    except Exception as e:  # noqa: BLE001 - the store's: OSError, or botocore's own (no credentials)
        if not (isinstance(e, OSError) and lost_race(e)):  # another writer's record: left alone
            raise StorageError(f"{url}: deleting it failed ({one_line(e)}); delete it by hand") from e
