"""The documentation as a reader meets it: the site builds with ``mkdocs build --strict``, its
pages render in a real browser (headless Chromium: highlighted code blocks, the CLI's option
lists, the API reference from the docstrings), and the examples in the README and on the site
run as written, each in its own folder."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

DOCS = ROOT / "docs"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _env() -> dict[str, str]:
    """This tree's ckptkit first, whatever the interpreter has installed."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}


def _browser() -> str:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH (Debian: apt-get install -y chromium)")


def _mkdocs() -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _mkdocs()
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in (
        "index.html",
        "cli/index.html",
        "formats/index.html",
        "training/index.html",
        "trainer/index.html",
        "safety/index.html",
        "reliability/index.html",
        "benchmarks/index.html",
        "api/index.html",
    ):
        assert (site / page).is_file(), page


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):  # up to 20 s for the server to listen
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if server.poll() is not None:
                pytest.fail(f"python -m http.server exited {server.returncode}")
            time.sleep(0.1)
        else:
            pytest.fail("python -m http.server did not listen within 20 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _dom(url: str, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, as headless Chromium has it."""
    browser = _browser()
    profile = tmp_path / "chromium-profile"
    args = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url,
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "<html" in proc.stdout, f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _highlighted_blocks(dom: str) -> list[str]:
    """Code blocks whose code the highlighter split into token spans."""
    blocks = re.findall(r'<div class="[^"]*highlight[^"]*">.*?</pre>', dom, flags=re.S)
    return [b for b in blocks if re.search(r"<code[^>]*>.*?<span class=\"\w+\">", b, flags=re.S)]


def test_the_cli_page_renders_highlighted_code_and_every_commands_options(served: str, tmp_path: Path) -> None:
    dom = _dom(f"{served}/cli/", tmp_path)
    assert len(_highlighted_blocks(dom)) >= 3, "no highlighted code blocks on the CLI page"
    # Material's scripts add the copy buttons in the browser: the built HTML has none
    assert re.search(r"md-clipboard|md-code__button", dom), (
        "Material's scripts did not run: no copy buttons on the code blocks"
    )
    for command in ("convert", "inspect", "diff", "verify", "check-adapter", "train"):
        assert f"ckptkit {command} --help" in dom, command
    assert "--max-shard-size" in dom and "--allow-global" in dom and "--save-every" in dom
    assert "click-help" not in dom, "a --help marker was left unreplaced"


def test_the_api_reference_renders_from_the_docstrings(served: str, tmp_path: Path) -> None:
    import ckptkit

    dom = _dom(f"{served}/api/", tmp_path)
    text = re.sub(r"<[^>]+>", "", dom)
    assert "doc-signature" in dom
    assert re.search(r"convert_checkpoint\(\s*src", text), "no convert_checkpoint signature on the API page"
    assert "max_shard_size" in text and "Raises" in text
    for name in ckptkit.__all__:
        if name != "__version__":
            assert f'id="ckptkit.{name}"' in dom, f"ckptkit.{name} has no entry on the API page"


def test_the_included_pages_render(served: str, tmp_path: Path) -> None:
    bench = _dom(f"{served}/benchmarks/", tmp_path)
    assert "<table" in bench and "--8&lt;--" not in bench and "--8<--" not in bench
    reliability = _dom(f"{served}/reliability/", tmp_path)
    assert "data lost" in reliability and "<table" in reliability


# -- the examples run as written, each in its own folder ------------------------------------------


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def _shell_examples() -> list[tuple[str, str]]:
    """Every bash block that makes its own folder first: those are written to run as they stand."""
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for i, code in enumerate(_blocks(page, "bash")):
            if code.startswith("mkdir -p "):
                found.append((f"{page.name}[{i}]", code))
    return found


@pytest.mark.parametrize(("where", "code"), _shell_examples(), ids=[w for w, _ in _shell_examples()])
def test_the_shell_examples_run_as_written(tmp_path: Path, where: str, code: str) -> None:
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ckptkit").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckptkit.cli "$@"\n')
    (shim / "ckptkit").chmod(0o755)
    (shim / "python").symlink_to(sys.executable)
    env = {**_env(), "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{where}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _python_examples() -> list[tuple[str, str]]:
    """The site's Python blocks (the README's run in tests/test_readme.py)."""
    return [
        (f"{page.name}[{i}]", code)
        for page in sorted(DOCS.glob("*.md"))
        for i, code in enumerate(_blocks(page, "python"))
    ]


@pytest.mark.dist
@pytest.mark.parametrize(("where", "code"), _python_examples(), ids=[w for w, _ in _python_examples()])
def test_the_sites_python_examples_run_as_written(tmp_path: Path, where: str, code: str) -> None:
    (tmp_path / "example.py").write_text(code)
    first = code.splitlines()[0]
    if first.startswith("# torchrun"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "example.py"]
    else:
        assert first.startswith("# python"), f"{where}: say how the block runs on its first line"
        cmd = [sys.executable, "example.py"]
    for attempt in ("first run", "second run: resumes or redoes"):
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where}, {attempt}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
