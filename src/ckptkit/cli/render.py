"""rich rendering for the CLI: tables to stdout, progress to stderr (terminals only).

rich is imported inside the functions that draw: ``ckptkit --help`` and the commands' error
paths then start without it (tests/cli/test_cli.py's test_help_is_fast_to_import).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

MAX_GROUPS = 40


def _stdout() -> Any:
    from rich.console import Console

    # Piped output: plain text, and wide enough that tables do not wrap key names.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _size(path: str) -> int:
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.path.getsize(path)
    except OSError:
        return 0


@contextlib.contextmanager
def progress_bar(*paths: str, threshold: int, enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing on stderr, or None when stderr is not a terminal or the files are small."""
    size = sum(_size(p) for p in paths)
    if not (enabled and sys.stderr.isatty() and size >= threshold):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(" + ".join(os.path.basename(p.rstrip("/")) for p in paths), total=size)

        def advance(done_now: int, total: int) -> None:
            bar.update(task, advance=done_now, total=max(total, 1))

        yield advance


def render_summary(s: Any, *, show_all: bool = False) -> None:
    from rich.table import Table

    out = _stdout()
    out.print(f"[bold]{s.path}[/]  {s.format}  {human_bytes(s.file_bytes)}")
    if s.needs_trust and s.pickled_module:
        out.print(
            f"[red]not loaded:[/] a pickled {s.pickled_module} module whose pickle calls or names {', '.join(s.needs_trust)}, "
            "beyond what its state_dict() needs, which could run code under torch.load. Pass --trust if you trust the file."
        )
        return
    if s.needs_trust:
        allow = " ".join(f"--allow-global {g}" for g in s.needs_trust)
        out.print(
            f"[red]not loaded:[/] its pickle needs {', '.join(s.needs_trust)}, outside torch's weights-only "
            f"allowlist, which could run code. Admit just these with {allow}, or pass --trust if you trust the file."
        )
        return
    if s.pickled_module:
        out.print(f"A pickled {s.pickled_module} module: its state_dict() was read without running the pickle")
    if s.producer:
        _render_producer(out, s.producer)
    if s.loaded_with_torch:
        out.print(
            "[dim](loaded with torch, trusted: weights_only=False)[/]"
            if s.trusted
            else "[dim](loaded with torch, weights-only)[/]"
        )
    if s.entries:
        t = Table("entry", "kind", "detail", title="Top level", title_justify="left", box=None, padding=(0, 2))
        for e in s.entries:
            t.add_row(e["name"], e["kind"], e["detail"])
        out.print(t)
    if s.weights_at is None:
        out.print("No model state dict found (use --key to point at it).")
    else:
        where = weights_where(s.weights_at)
        by_dtype = ", ".join(f"{d} {human_bytes(b)}" for d, b in s.bytes_by_dtype.items())
        devices = ", ".join(f"{d} ({n})" if len(s.devices) > 1 else d for d, n in s.devices.items())
        shared = f" ({s.shared} sharing another's storage: stored once)" if s.shared else ""
        out.print(
            f"Weights at {where}: {len(s.tensors)} tensors{shared}, {s.numel:,} elements, {by_dtype}; saved on {devices or '-'}"
        )
        prefixes = s.prefixes
        leading = "".join(prefixes.get("leading", []))
        nested = ", ".join(prefixes.get("nested", []))
        if leading or nested:
            hint = " -> plain keys with: ckptkit convert FILE OUT.pt" if leading else ""
            out.print(f"Wrapper prefixes: {leading or '-'}{'; nested ' + nested if nested else ''}{hint}")
        else:
            out.print("Wrapper prefixes: none (plain single-device keys)")
        if prefixes.get("common") and (s.producer or {}).get("name") == "lightning":
            # A LightningModule's attribute (self.model) over its state_dict: stripping it gives the inner
            # model's keys. Anywhere else a shared first name is the model's own (fc., transformer.): keep it.
            common = prefixes["common"]
            out.print(
                f"Every key starts with the LightningModule attribute {common!r}: --strip {common} gives the inner model's keys"
            )
        groups = s.groups()
        t = Table("key", "n", "layers", "shape", "dtype", "size", box=None, padding=(0, 2))
        for g in groups if show_all else groups[:MAX_GROUPS]:
            t.add_row(g["pattern"], str(g["count"]), g["range"], g["shape"], g["dtype"], human_bytes(g["nbytes"]))
        out.print(t)
        if len(groups) > MAX_GROUPS and not show_all:
            out.print(f"... {len(groups) - MAX_GROUPS} more key groups (--all lists them)")
    if s.metadata:
        out.print("Metadata: " + ", ".join(f"{k}={v}" for k, v in s.metadata.items()))


def _render_producer(out: Any, p: dict[str, Any]) -> None:
    """Who wrote it, where its weights and EMA copy are, and a folder's other files."""
    from rich.table import Table

    out.print(f"[bold]{p['what']}[/]")
    if p.get("weights") is not None:
        ema = p.get("ema")
        also = (
            " (the averaged / EMA weights)"
            if ema and ema == p["weights"]
            else f"; EMA copy: {ema} (--key {ema})"
            if ema
            else ""
        )
        out.print(f"  weights: {p['weights'] if p['weights'] not in ('', '.') else weights_where(p['weights'])}{also}")
    for note in p.get("notes", []):
        out.print(f"  note: {note}")
    if p.get("files"):
        t = Table("file", "holds", box=None, padding=(0, 2), title="Files", title_justify="left")
        for f in p["files"]:
            t.add_row(f["name"], f["holds"])
        out.print(t)


def render_diff(r: Any) -> None:
    from rich.table import Table

    out = _stdout()
    if r.equal:
        tol = f" within atol={r.atol:g}, rtol={r.rtol:g}" if r.atol or r.rtol else ""
        out.print(f"same weights: {r.compared} tensors compared{tol}")
        return
    out.print(
        f"[bold]weights differ[/]: {len(r.differences)} of {r.compared} shared tensors, "
        f"{len(r.only_in_a)} only in A, {len(r.only_in_b)} only in B"
    )
    if r.only_in_a:
        out.print("only in A: " + ", ".join(r.only_in_a[:20]) + (" ..." if len(r.only_in_a) > 20 else ""))
    if r.only_in_b:
        out.print("only in B: " + ", ".join(r.only_in_b[:20]) + (" ..." if len(r.only_in_b) > 20 else ""))
    if r.differences:
        t = Table("tensor", "differs in", "A", "B", "max |A-B|", box=None, padding=(0, 2))
        for d in r.differences[:50]:
            worst = "" if d.max_abs_diff is None else f"{d.max_abs_diff:.6g}"
            t.add_row(d.name, d.reason, f"{d.a_dtype}{d.a_shape}", f"{d.b_dtype}{d.b_shape}", worst)
        out.print(t)
        if len(r.differences) > 50:
            out.print(f"... {len(r.differences) - 50} more (--json lists all)")


def render_adapter(r: Any) -> None:
    """check-adapter's findings, one line each; or that it applies."""
    from rich.markup import escape

    out = _stdout()
    if r.ok:
        out.print(f"applies: {r.modules} modules of {escape(r.base)} adapted, every key matched, shapes fit")
        return
    if r.unmatched:
        fix = f"; fix: {r.fix}" if r.fix else "; no rename makes them match: is this the adapter's base?"
        out.print(
            f"[bold]{len(r.unmatched)} key(s) name no base module[/] (PEFT would load them into nothing): "
            + escape(", ".join(r.unmatched[:3]) + (" ..." if len(r.unmatched) > 3 else "") + fix)
        )
    if r.untargeted:
        out.print(
            f"[bold]{len(r.untargeted)} targeted module(s) got no adapter[/]: "
            + escape(", ".join(r.untargeted[:3]) + (" ..." if len(r.untargeted) > 3 else ""))
        )
    for line in r.shapes[:10]:
        out.print("[bold]shape[/]: " + escape(line))
    if len(r.shapes) > 10:
        out.print(f"... {len(r.shapes) - 10} more shape mismatches (--json lists all)")
    if r.zero_b:
        out.print(
            f"[bold]{len(r.zero_b)} lora_B tensor(s) all zero[/]: "
            + escape(", ".join(r.zero_b[:3]) + (" ..." if len(r.zero_b) > 3 else ""))
        )


def render_verify(r: Any) -> None:
    from rich.markup import escape  # a detail is text: "pip install 'ckptkit[s3]'" must keep its [s3]

    out = _stdout()
    for c in r.checks:
        mark = "[green]ok  [/]" if c.ok else "[red]FAIL[/]"
        out.print(f"{mark} {escape(c.name)}" + (f": {escape(c.detail)}" if c.detail else ""))
    out.print(f"{escape(str(r.path))}: {'[green]verified[/]' if r.ok else '[red]problems found[/]'}")


def weights_where(weights_at: str) -> str:
    """Where the weights were, in words: ``'model'``; the top level; beside the top level's other entries."""
    if weights_at == ".":  # torchtitan: the tensors among the top level's other entries
        return "the top level, beside its other entries"
    return f"'{weights_at}'" if weights_at else "the top level"
