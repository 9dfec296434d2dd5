"""Where a copied range should land within a page, so the kernel copies whole pages.

A copy that keeps each byte at its source's offset within a page is the kernel's fastest (on
ext4, 2.7-3.1x a whole convert here: BENCHMARKS.md, bench_devices.py). A writer that pads before a
long copy (a zip record's extra field) or before its data (a safetensors header) can keep the
bytes there, for a few KiB of padding at most.
"""

from __future__ import annotations

from collections.abc import Iterable

PAGE = 4096  # the page size the kernel copies in (x86-64, most aarch64)
PAGE_FROM = 1 << 20  # copies shorter than this are not worth padding to their source's page offset


def page_pad(at: int, like: int, length: int, *, alignment: int) -> int:
    """Bytes of padding before a copy of ``length`` bytes from source offset ``like``, to be
    written from ``at``: the fewest that start it at ``alignment`` (a divisor of :data:`PAGE`),
    or, for a copy of :data:`PAGE_FROM` bytes or more from an aligned ``like``, the fewest that
    also start it at the same offset within a page as its source.

    Example:
        >>> page_pad(100, 64, 10, alignment=64), page_pad(100, 64, 1 << 20, alignment=64)
        (28, 4060)
    """
    if length >= PAGE_FROM and like % alignment == 0 and PAGE % alignment == 0:
        return (like - at) % PAGE
    return -at % alignment


def page_residue(spans: Iterable[tuple[int, int, int]]) -> int | None:
    """Where data should start, modulo the page size, for ``(offset in the data section, source
    offset, length)`` copies: the residue under which the most bytes land at the same offset
    within a page as in their source (None when no span is long enough to matter).

    For a writer that keeps its copies back to back (safetensors), where only the start of
    the data can move. Residues stay multiples of 8, as
    safetensors' own writer keeps data 8-aligned.

    Example:
        >>> page_residue([(0, 4096 + 64, 1 << 20), (1 << 20, 9000, 100)])
        64
    """
    weight: dict[int, int] = {}
    for rel, src, length in spans:
        r = (src - rel) % PAGE
        if r % 8 == 0 and length >= PAGE_FROM:
            weight[r] = weight.get(r, 0) + length
    return max(weight, key=lambda r: weight[r]) if weight else None
