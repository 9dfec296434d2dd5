"""The reference trainer's log: JSON lines, readable lines, a progress bar (rank 0 only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _number(v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"  # 18,240 samples/s, not 1.824e+04


class Logger:
    """Rank 0 only: JSON lines to metrics.jsonl, readable lines on stdout, and a rich
    progress bar when stdout is a terminal."""

    def __init__(self, path: Path, *, enabled: bool, progress: bool = False) -> None:
        self.enabled = enabled
        self.file = open(path, "a", buffering=1) if enabled else None  # line-buffered: a crash loses no line
        self.bar: Any = None
        self.task: Any = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=True,
            )

    def _write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, highlight=False, markup=False)  # above the bar; "[end]" is text
        else:
            print(text, flush=True)

    def start_bar(self, total: int, done: int) -> None:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("steps", total=total, completed=done)

    def advance(self, epoch: int) -> None:
        if self.task is not None:  # counts optimizer steps over the whole run; the epoch is where it is
            self.bar.update(self.task, advance=1, description=f"steps (epoch {epoch})")

    def metric(self, **values: Any) -> None:
        if self.enabled:
            self._write(values)
            self._print(" | ".join(f"{k} {_number(v)}" for k, v in values.items()))

    def note(self, text: str) -> None:
        """A line for the reader (not a record): a hint about what to do next."""
        if self.enabled:
            self._print(f"note: {text}")

    def event(self, name: str, *, line: str | None = None, **values: Any) -> None:
        """A record; on stdout ``line``, where given, else ``[name] key=value ...``."""
        if self.enabled:
            self._write({"event": name, **values})
            if line is not None:
                self._print(line)
            elif name != "save":
                shown = {k: v for k, v in values.items() if k != "config"}
                self._print(f"[{name}] " + " ".join(f"{k}={v}" for k, v in shown.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.file is not None:
            self.file.close()
