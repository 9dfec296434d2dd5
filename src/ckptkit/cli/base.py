"""The ``ckptkit`` group and what every command shares: errors as one line, exit codes."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from ckptkit.errors import ArgumentError, CkptkitError, cli_spelling

from ._stop import stopped_while_loading

F = TypeVar("F", bound=Callable[..., Any])
BIG = 64 << 20  # show a progress bar for files from this size, on a terminal


class Stopped(BaseException):
    """A termination signal, raised where the command is so that its cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the body runs (torch's start-up), then raise them.

    An interrupt raised inside torch's import lands in C++ that calls back into Python. Seen
    here under load: the process aborting (pybind11 ``error_already_set``, exit -6), or ending by
    SIGINT after its one error line (exit -2), instead of exiting 130 with that line.
    """
    got: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _: got.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got and got[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if got:
        raise Stopped(got[0])


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM (a scheduler, ``timeout``) and SIGHUP (a closed terminal) unwind like Ctrl-C:
    a half-written output is removed on the way out instead of being left behind."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def fail(message: str, code: int, *, as_json: bool = False, kind: str = "error") -> None:
    """One line on stderr; with ``--json`` also a JSON object on stdout, for scripts.

    A message quotes what a file holds (names, torch's words): a line break or a terminal escape
    in them is shown escaped, as Python's ``repr`` would, never acted on.
    """
    message = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message.strip())
    if as_json:
        emit_json({"ok": False, "error": {"type": kind, "message": message, "exit_code": code}})
    click.echo(f"ckptkit: error: {message}", err=True)
    sys.exit(code)


def handle_errors(
    fn: F | None = None, *, trouble: int = 1, stopped: tuple[str, int] | None = None, logs: bool = False
) -> Any:
    """Turn expected errors into one line on stderr and an exit code.

    Exit codes: 2 for usage errors (and for every error of a command whose 1 means "different",
    ``trouble=2``, as GNU diff does), else 1; 128 + N for signal N, nothing left behind. Messages
    name command-line flags (``--trust``), not keywords; torch's warnings are not for the command
    line's user (``--debug`` shows them, with tracebacks). ``stopped``: what to say, and the exit
    code, when a signal stops the command (default: nothing was written, 128 + N). Nor are the
    log lines of the libraries a trusted unpickle imports (torchao's "Failed to load" of its CUDA
    kernels, torch's own): below ERROR they are dropped unless ``--debug``, or ``logs`` (the
    trainer, whose progress is its log).
    """
    if fn is None:
        return functools.partial(handle_errors, trouble=trouble, stopped=stopped, logs=logs)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = click.get_current_context().find_root().params.get("debug", False)
        as_json = bool(kwargs.get("as_json"))
        try:
            with cli_spelling(), _stop_on_signals(), warnings.catch_warnings(), _library_logs(shown=debug or logs):
                if not debug:
                    warnings.simplefilter("ignore")
                return fn(*args, **kwargs)
        except (CkptkitError, OSError) as e:
            if debug:
                raise
            code = 2 if isinstance(e, ArgumentError) else trouble
            kind = type(e).__name__
            fail(str(e) if isinstance(e, CkptkitError) else f"{kind}: {e}", code, as_json=as_json, kind=kind)
        except (KeyboardInterrupt, Stopped) as e:
            name = signal.Signals(e.signum).name if isinstance(e, Stopped) else "SIGINT"
            what, code = stopped or (
                "nothing was written",
                128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT),
            )
            fail(f"stopped by {name}; {what}", code, as_json=as_json, kind=name)

    return wrapper


@contextlib.contextmanager
def _library_logs(*, shown: bool) -> Iterator[None]:
    """Log records below ERROR dropped for the block, unless ``shown``."""
    if shown:
        yield
        return
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


class _Group(click.Group):
    """The commands; ``train``'s module (the trainer's options, logging, argparse) is imported
    only when ``train`` runs or help lists it, so the other commands start ~10 ms sooner."""

    lazy = {"train": "ckptkit.cli.launch"}  # command -> the module that registers it on ``main``

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            try:
                importlib.import_module(self.lazy[cmd_name])
            except KeyboardInterrupt:
                stopped_while_loading()
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="ckptkit")
def main(debug: bool) -> None:
    """Move PyTorch checkpoints between DP/DDP/compiled and single-device models, safely.

    \b
    Examples:
      ckptkit convert ddp.pt single.pt           # strip module. / _orig_mod.
      ckptkit convert single.pt ddp.pt --to ddp  # add module.
      ckptkit convert ckpt.pt model.safetensors --model-only
      ckptkit inspect ckpt.pt
      ckptkit diff ddp.pt single.safetensors
      ckptkit verify ckpt.pt
    """
