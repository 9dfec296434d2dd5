"""A DCP folder's tensor as an :class:`~..entry.Entry`: the pieces of ``.distcp`` files its bytes
are, in order, found lazily (:mod:`.stream` opens the folder and copies them).

Example:
    >>> p = Piece("__0_0.distcp", 4096, 64, 0x1234, "chunk at [0] in __0_0.distcp")
    >>> p.length
    64
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

from ...io.crcmath import crc32_combine
from ...io.fileio import Progress
from ..dtypes import BY_NAME
from ..entry import Entry

if TYPE_CHECKING:
    from .stream import DcpSource


class Piece(NamedTuple):
    """``length`` bytes at ``offset`` of ``file`` (a ``.distcp`` name), whose CRC-32 is ``crc``."""

    file: str
    offset: int
    length: int
    crc: int
    where: str  # "chunk at [19, 0] in __1_0.distcp", for messages


@dataclass(eq=False)
class DcpTensor(Entry):
    """A full tensor as the pieces of its bytes, in order. Where :func:`open_dcp` was ``lazy``,
    they are found when first asked for, or before that by a helper thread while an earlier
    tensor is copied (:meth:`write`); an error found then is raised when they are asked for, in
    the writer's order, as it would have been."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    find: Callable[[], tuple[Piece, ...]] = field(repr=False)
    src: DcpSource = field(repr=False)
    _found: tuple[Piece, ...] | None = field(default=None, repr=False)
    zip = None
    complete = True

    @property
    def ident(self) -> DcpTensor:  # each tensor its own storage
        return self

    storage = ident

    # Entry declares storage_size, crc and nbytes as plain attributes; here they are computed, read-only
    # (no user of an Entry writes them): hence ignore[override], as in cast.py and deepspeed/stream.py.
    @property
    def storage_size(self) -> int:  # type: ignore[override]
        return self.nbytes

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int:
        return self.src.copy(self, f, progress)

    def find_crc(self) -> int | None:
        self.pieces  # noqa: B018 - found now: they are copied next
        return self.crc

    @property
    def pieces(self) -> tuple[Piece, ...]:
        if self._found is None:
            self._found = self.find()
        return self._found

    @property
    def crc(self) -> int | None:  # type: ignore[override]
        """The CRC-32 its bytes have where each chunk's match the CRC-32 its zip records; None
        until its pieces are found (a writer does not wait for them)."""
        if self._found is None:
            return None
        crc = 0
        for p in self._found:
            crc = crc32_combine(crc, p.crc, p.length)
        return crc

    @property
    def nbytes(self) -> int:  # type: ignore[override]  # what the pieces add up to: each chunk was checked against .metadata
        return math.prod(self.shape) * BY_NAME[self.dtype].itemsize
