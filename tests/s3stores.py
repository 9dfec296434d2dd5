"""The local S3 servers the tests write to: moto as it is, and moto as a store that ignores S3's
checksum headers (MinIO and other S3-compatible stores did, boto3#4392): it neither checks nor
echoes a CRC-32, so each commit falls back to reading the object back.

No second S3-compatible server installs here from the package index or Debian (Debian's rclone
1.60 predates ``rclone serve s3``), so the issue's fallback is taken: moto with checksums off,
at the HTTP level, so the CLI's own processes meet it too.

Example:
    >>> server, endpoint = start(checksums=False)  # doctest: +SKIP
"""

from __future__ import annotations

import io
import re
import socket
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
from werkzeug.serving import make_server

# The request headers that declare or ask for checksums, as WSGI names them.
_ASKED = ("HTTP_X_AMZ_CHECKSUM", "HTTP_X_AMZ_SDK_CHECKSUM")
_ELEMENTS = re.compile(rb"<Checksum(CRC32C?|CRC64NVME|SHA1|SHA256|Type)>[^<]*</Checksum\1>")


class WithoutChecksums:
    """WSGI middleware: the checksum headers and XML elements of requests are dropped before moto
    sees them, and those of its answers before the client does."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        for k in [k for k in environ if k.startswith(_ASKED)]:
            del environ[k]
        if environ["REQUEST_METHOD"] == "POST" and "uploadId=" in environ.get("QUERY_STRING", ""):
            body = _ELEMENTS.sub(b"", environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
            environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        answer: list[Any] = []
        result = self.app(environ, lambda status, headers, *exc: answer.extend([status, headers, *exc]))
        status, headers, *exc = answer
        headers = [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum")]
        if not any(k.lower() == "content-type" and "xml" in v for k, v in headers):
            start_response(status, headers, *exc)
            return result
        body = _ELEMENTS.sub(b"", b"".join(result))  # a small XML answer (CompleteMultipartUpload's)
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in headers]
        start_response(status, headers, *exc)
        return [body]


class WithS3Ranges:
    """WSGI middleware: a ranged GET of an object is answered by reading that range of moto's copy,
    as S3 answers one. moto reads the whole object for each ranged GET (its ``FakeKey.value``), so
    a reader that asks for a large object in many ranges, as S3's own clients do, would make it
    read the object that many times; the benchmarks measure the client, not that."""

    _RANGE = re.compile(r"bytes=(\d+)-(\d+)")

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        asked = self._RANGE.fullmatch(environ.get("HTTP_RANGE", ""))
        if environ["REQUEST_METHOD"] != "GET" or asked is None or environ.get("QUERY_STRING"):
            return self.app(environ, start_response)
        bucket, _, name = urllib.parse.unquote(environ["PATH_INFO"]).lstrip("/").partition("/")
        try:
            key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name) if name else None
        except Exception:  # noqa: BLE001 - no such bucket: moto's own answer
            key = None
        start, end = int(asked[1]), int(asked[2])
        if key is None or start >= key.size or start > end or environ.get("HTTP_IF_MATCH", key.etag) != key.etag:
            return self.app(environ, start_response)  # moto's own answer: 404, 416, 412
        end = min(end, key.size - 1)
        with key.lock:
            key._value_buffer.seek(start)
            body = key._value_buffer.read(end - start + 1)
        start_response(
            "206 Partial Content",
            [
                ("Content-Type", "binary/octet-stream"),
                ("Content-Length", str(len(body))),
                ("Content-Range", f"bytes {start}-{end}/{key.size}"),
                ("ETag", key.etag),
                ("Last-Modified", key.last_modified_RFC1123),
                ("Accept-Ranges", "bytes"),
            ],
        )
        return [body]


class _Server(ThreadedMotoServer):
    def __init__(self, port: int, *, checksums: bool, ranges: bool) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.checksums, self.ranges = checksums, ranges

    def _server_entry(self) -> None:  # ThreadedMotoServer's, with the middleware where asked
        app: Any = DomainDispatcherApplication(create_backend_app)
        app = app if self.checksums else WithoutChecksums(app)
        app = WithS3Ranges(app) if self.ranges else app
        self._server = make_server(self._ip_address, self._port, app, True)
        self._server_ready_event.set()
        self._server.serve_forever()


def start(*, checksums: bool = True, ranges: bool = False) -> tuple[ThreadedMotoServer, str]:
    """A local S3 server on a free port, started; and its endpoint. ``ranges``: ranged GETs read
    only their range (:class:`WithS3Ranges`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _Server(port, checksums=checksums, ranges=ranges)
    server.start()
    return server, f"http://127.0.0.1:{port}"
