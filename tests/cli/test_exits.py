"""The command line's exits: signals leave nothing, exit codes, one-line and JSON errors, honest
summaries and progress (issue 11)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from tests.conftest import ROOT

TMP_SUFFIX = ".ckptkit-tmp"


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def cli(cwd: Path, *args: object, timeout: float = 120, **kw: object) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "ckptkit.cli", *(str(a) for a in args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )  # type: ignore[call-overload]


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- signals during convert leave nothing -------------------------------------------------


# The command is held just before it would publish (``os.replace`` onto the output), so that the
# signal always lands mid-convert: a fast machine finished a 256 MiB convert between the test
# seeing the temp file and sending the signal.
HELD = """
import os, pathlib, runpy, sys, time
real, held = os.replace, pathlib.Path(sys.argv.pop(1))
def replace(src, dst, **kw):
    if os.path.basename(dst) == "out.pt":
        held.touch()
        time.sleep(600)
    return real(src, dst, **kw)
os.replace = replace
runpy.run_module("ckptkit.cli", run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_convert_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    work, held = tmp_path / "work", tmp_path / "held"
    work.mkdir()
    torch.save({"w": torch.zeros(1 << 20, dtype=torch.float32)}, work / "big.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", HELD, str(held), "convert", "big.pt", "out.pt"]
    proc = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not held.exists():  # written, checked, about to be published
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    assert [p.name for p in work.iterdir() if p.name.endswith(TMP_SUFFIX)]  # the output's temp file is there
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert lines(err) == [f"ckptkit: error: stopped by {sig.name}; nothing was written"]
    assert sorted(p.name for p in work.iterdir()) == ["big.pt"]


# -- diff: 0 same, 1 different, 2 trouble --------------------------------------------------


def test_diff_exit_codes_follow_gnu_diff(fixtures_dir: Path, tmp_path: Path) -> None:
    assert run("diff", fixtures_dir / "ddp.pt", fixtures_dir / "plain.pt")[0] == 0
    other = {k: v + 1 if v.is_floating_point() else v for k, v in torch.load(fixtures_dir / "plain.pt").items()}
    ckptkit.save_on_master(other, tmp_path / "other.pt")
    assert run("diff", fixtures_dir / "plain.pt", tmp_path / "other.pt")[0] == 1
    for b in (tmp_path / "missing.pt", fixtures_dir / "needs_trust.pt"):
        code, _, err = run("diff", fixtures_dir / "plain.pt", b)
        assert code == 2 and len(lines(err)) == 1 and err.startswith("ckptkit: error:"), err


# -- --json errors are JSON ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "kind"),
    [
        (["convert", "missing.pt", "o.pt"], 1, "CheckpointNotFoundError"),
        (["convert", "{fx}/needs_trust.pt", "o.pt"], 1, "UnsafeCheckpointError"),
        (["convert", "{fx}/plain.pt", "o.zzz"], 2, "ArgumentError"),
        (["inspect", "missing.pt"], 1, "CheckpointNotFoundError"),
        (["diff", "{fx}/plain.pt", "missing.pt"], 2, "CheckpointNotFoundError"),
        (["verify", "{fx}"], 1, None),  # verify reports a folder without .metadata as a failed check
    ],
)
def test_json_errors_are_json_on_stdout(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, kind: str | None
) -> None:
    monkeypatch.chdir(tmp_path)
    got, out, err = run(*[a.format(fx=fixtures_dir) for a in args], "--json")
    assert got == code, err
    data = json.loads(out)
    assert data["ok"] is False
    if kind is not None:
        assert data["error"]["type"] == kind and data["error"]["exit_code"] == code
        assert lines(err) == [f"ckptkit: error: {data['error']['message']}"]


# -- summaries that say what was left and what was stored once ----------------------------


def test_convert_says_which_other_copy_of_the_weights_it_left(fixtures_dir: Path, tmp_path: Path) -> None:
    ddp = torch.load(fixtures_dir / "ddp.pt", weights_only=True)
    torch.save({"model": ddp, "ema": {"model": ddp}, "step": 7}, tmp_path / "ema.pt")
    code, out, err = run("convert", tmp_path / "ema.pt", tmp_path / "single.pt")
    assert code == 0, err
    assert "note: 'ema/model' also holds wrapped weights, left as they were; convert them with --key ema/model" in err
    report = ckptkit.convert_checkpoint(tmp_path / "ema.pt", tmp_path / "again.pt")
    assert report.left == ["ema/model"]
    again = ckptkit.convert_checkpoint(tmp_path / "single.pt", tmp_path / "both.pt", key="ema/model")
    assert again.left == [] and again.renamed == 9  # the note's command does convert it


def test_a_tied_safetensors_output_says_what_was_stored_once(fixtures_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    code, out, err = run("convert", fixtures_dir / "tied_ddp.pt", tmp_path / "tied.safetensors")
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'tied.safetensors'}: 4 tensors (3 stored)")
    assert "stored once and re-tied on load: head.weight is embed.weight" in err and "load_model" in err
    assert len(load_file(str(tmp_path / "tied.safetensors"))) == 3  # what the note warns about
    assert len(ckptkit.read_checkpoint(tmp_path / "tied.safetensors")) == 4


def test_inspect_counts_in_words(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(1)}, "one": {"a": 1}, "pair": [1, 2], "single": [3]}, tmp_path / "c.pt")
    code, out, _ = run("inspect", tmp_path / "c.pt")
    assert code == 0
    assert re.search(r"\bone\s+dict\s+1 entry\b", out) and re.search(r"\bsingle\s+list\s+1 item\b", out)
    assert re.search(r"\bpair\s+list\s+2 items\b", out) and re.search(r"\bmodel\s+state dict\s+1 tensor\b", out)


# -- progress for verify and diff ----------------------------------------------------------


def test_verify_and_diff_report_progress(fixtures_dir: Path, tmp_path: Path) -> None:
    ckptkit.save_on_master({"w": torch.ones(1 << 16), "b": torch.zeros(100)}, tmp_path / "a.pt")
    seen: list[tuple[int, int]] = []
    assert ckptkit.verify_checkpoint(tmp_path / "a.pt", progress=lambda n, total: seen.append((n, total))).ok
    payload = 4 * ((1 << 16) + 100)
    assert sum(n for n, _ in seen) >= payload and {t for _, t in seen} == {(tmp_path / "a.pt").stat().st_size}
    seen.clear()
    assert ckptkit.diff_checkpoints(
        tmp_path / "a.pt", tmp_path / "a.pt", progress=lambda n, t: seen.append((n, t))
    ).equal
    assert sum(n for n, _ in seen) == 2 * payload and seen[-1][1] == 2 * payload


def test_paths_are_checked_by_ckptkit_not_by_click() -> None:
    """click's own readability check turned an unreadable SRC into a usage error (exit 2, usage
    text); ckptkit opens the file and says what is wrong in its one line, exit 1."""
    import click

    ctx = click.Context(main)
    names = main.list_commands(ctx)
    assert {"convert", "inspect", "diff", "verify", "train"} <= set(names)  # train's module loads on demand
    for name in names:
        command = main.get_command(ctx, name)
        assert command is not None, name
        for param in command.params:
            if isinstance(param.type, click.Path):
                assert not param.type.readable and not param.type.exists, (name, param.name)


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_an_error_quoting_a_hostile_name_stays_one_line(tmp_path: Path, command: str) -> None:
    """A record name holding a line break and a terminal escape is shown escaped, never acted on."""
    src = tmp_path / "base.pt"
    torch.save({"w": torch.ones(2)}, src)
    data = src.read_bytes()
    name = b"base/.data/serialization_id"
    hostile = b"x\n\x1b[2J/serialization_id____"  # as long as the name it replaces: the zip's offsets hold
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data.replace(name, hostile))
    args = [command, bad] + ([tmp_path / "out.safetensors"] if command == "convert" else [])
    code, _, err = run(*args)
    assert code == 1 and err.count("\n") == 1 and err.startswith("ckptkit: error: "), err
    assert "\x1b" not in err and "\\x1b[2J" in err and "\\n" in err
