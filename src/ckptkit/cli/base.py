"""The ``ckptkit`` group and what every command shares: errors as one line, exit codes."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ckptkit.errors import ArgumentError, CkptkitError, cli_spelling

F = TypeVar("F", bound=Callable[..., Any])
BIG = 64 << 20  # show a progress bar for files from this size, on a terminal


def fail(message: str, code: int) -> None:
    click.echo(f"ckptkit: error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: F) -> F:
    """Turn expected errors into one line on stderr and an exit code.

    Messages name command-line flags (``--trust``), not keywords; torch's warnings are not for
    the command line's user (``--debug`` shows them, with tracebacks).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = click.get_current_context().find_root().params.get("debug", False)
        try:
            with cli_spelling(), warnings.catch_warnings():
                if not debug:
                    warnings.simplefilter("ignore")
                return fn(*args, **kwargs)
        except (CkptkitError, OSError) as e:
            if debug:
                raise
            fail(str(e) if isinstance(e, CkptkitError) else f"{type(e).__name__}: {e}", 2 if isinstance(e, ArgumentError) else 1)
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)

    return wrapper  # type: ignore[return-value]


def emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
