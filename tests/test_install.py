"""Installing ckptkit as a user does: the README's commands in a fresh venv, and the wheel.

Each venv here is made without ``--system-site-packages``, so what it holds is only what these
tests install into it (torch from pip's usual sources, where ``torch==2.13.0`` is a local wheel
in CI), whether the interpreter running pytest is itself in a venv or not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT

TORCH = "torch==2.13.0"  # the README's pin


def test_numpy_is_a_dependency() -> None:
    from importlib.metadata import requires

    assert any(r.startswith("numpy") for r in requires("ckptkit") or [])


class Venv:
    """A fresh venv with pip and nothing else; commands run with its bin/ first on PATH."""

    def __init__(self, path: Path) -> None:
        # From the interpreter this one was made from: a venv inside a venv is as plain as any.
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        python = str(base) if base.exists() else sys.executable
        subprocess.run([python, "-m", "venv", str(path)], check=True, timeout=300, capture_output=True)
        self.bin = path / "bin"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env = {
            **env,
            "OMP_NUM_THREADS": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "VIRTUAL_ENV": str(path),
            "PATH": f"{self.bin}:{env['PATH']}",
        }

    def run(self, *cmd: object, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def pip_install(self, *args: object, cwd: Path) -> None:
        done = self.run("pip", "install", "-q", *args, cwd=cwd, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _readme_blocks() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.slow
def test_a_new_user_from_the_parent_folder_of_a_fresh_clone(tmp_path: Path) -> None:
    """The README's install, then its commands, from the folder that holds the clone: the clone's
    root (named ckptkit) must not shadow the installed package there."""
    assert (ROOT / ".git").exists(), "run from a git checkout: this test clones it"
    clone = tmp_path / "ckptkit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    venv = Venv(tmp_path / "venv")
    venv.pip_install(TORCH, cwd=clone)  # the README's "pip install torch==2.13.0 && pip install -e ."
    venv.pip_install("-e", ".", cwd=clone)

    where = venv.run(
        "python",
        "-c",
        "import ckptkit; print(ckptkit.__file__, ckptkit.ResumableDistributedSampler.__name__)",
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == [str(clone / "src" / "ckptkit" / "__init__.py"), "ResumableDistributedSampler"]
    assert venv.run("ckptkit", "--help", cwd=tmp_path).returncode == 0
    trained = venv.run("ckptkit", "train", "--nproc", "2", "--epochs", "1", "--out", "run", cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert (tmp_path / "run" / "model.safetensors").exists()
    first = next(b for b in _readme_blocks() if b.startswith("# python"))  # one process, as the block says
    (tmp_path / "example.py").write_text(first)
    example = venv.run("python", "example.py", cwd=tmp_path)
    assert example.returncode == 0, example.stderr[-2000:]


@pytest.mark.slow
def test_the_wheel_installs_and_runs(tmp_path: Path) -> None:
    """``python -m build`` of this tree, installed into a fresh venv: the command runs and converts."""
    pytest.importorskip("build", reason="python -m build needs the 'build' package (the test extra has it)")
    tree = tmp_path / "tree"  # a copy, so that the build leaves nothing in the checkout
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(tmp_path / "dist"), str(tree)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # (byte-compiling is off where PYTHONDONTWRITEBYTECODE is set: the machine's, not the project's)
    warned = [
        line
        for line in (built.stdout + built.stderr).splitlines()
        if "warning" in line.lower() and "byte-compiling is disabled" not in line
    ]
    assert not warned, warned
    (wheel,) = (tmp_path / "dist").glob("ckptkit-*-py3-none-any.whl")
    (sdist,) = (tmp_path / "dist").glob("ckptkit-*.tar.gz")
    with zipfile.ZipFile(wheel) as z:  # the licence travels with the package, and the metadata names it
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
        metadata = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in metadata
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("/LICENSE") for n in tar.getnames())

    venv = Venv(tmp_path / "venv")
    venv.pip_install(TORCH, wheel, cwd=tmp_path)
    where = venv.run(
        "python", "-c", "import ckptkit, pathlib; print(pathlib.Path(ckptkit.__file__).parent)", cwd=tmp_path
    )
    assert where.returncode == 0, where.stderr
    installed = Path(where.stdout.strip())
    assert installed.is_relative_to(tmp_path / "venv") and (installed / "py.typed").exists()

    helped = venv.run("ckptkit", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "convert" in helped.stdout, helped.stderr
    shutil.copy2(FIXTURES / "ddp.pt", tmp_path / "ddp.pt")  # DDP's module. keys
    converted = venv.run("ckptkit", "convert", "ddp.pt", "single.pt", cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    assert "(module. -> no prefix)" in converted.stdout
    for command in ("inspect", "verify"):
        ran = venv.run("ckptkit", command, "single.pt", cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
    keys = venv.run("python", "-c", "import torch; print(*torch.load('single.pt', weights_only=True))", cwd=tmp_path)
    assert (
        keys.returncode == 0 and keys.stdout.split() and not any(k.startswith("module.") for k in keys.stdout.split())
    )
