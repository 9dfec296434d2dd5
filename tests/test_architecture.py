"""The layers hold: formats is torch-free, nothing imports upward or in a cycle, the CLI and the
trainer use only the public API, and a function-level import only ever defers torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit

PACKAGE = Path(ckptkit.__file__).resolve().parent
PUBLIC = {"ckptkit", "ckptkit.errors", "ckptkit.prefix"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The ckptkit modules an ``from X import a, b`` statement in ``module`` names."""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if not base.startswith("ckptkit"):
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs or [base]


def _imports(module: str) -> tuple[set[str], set[str], bool]:
    """(ckptkit modules imported at module level, any module imported inside a function, imports torch at module level)."""
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    inner: set[str] = set()
    torch = False

    def visit(node: ast.AST, in_function: bool, in_type_checking: bool) -> None:
        nonlocal torch
        for child in ast.iter_child_nodes(node):
            function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            checking = in_type_checking or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                names = (
                    _resolve(module, child)
                    if child.level or (child.module or "").startswith("ckptkit")
                    else [child.module or ""]
                )
            if not checking:
                for name in names:
                    if name.split(".")[0] == "torch" and not function:
                        torch = True
                    if name.startswith("ckptkit") or function:
                        (inner if function else top).add(name)
            visit(child, function, checking)

    visit(tree, False, False)
    top.discard(module)
    return top, inner, torch


GRAPH = {m: _imports(m) for m in MODULES}


def _imports_torch(module: str, seen: frozenset[str] = frozenset()) -> bool:
    top, _, torch = GRAPH[module]  # top holds only ckptkit modules
    return torch or any(_imports_torch(m, seen | {module}) for m in top if m in GRAPH and m not in seen)


def _within(module: str, *packages: str) -> bool:
    """True where ``module`` is one of ``packages`` or inside one (``ckptkit.train`` holds not ``ckptkit.training``)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def _torch_half(module: str) -> bool:
    """A format's torch half (``formats/dcp/torch.py``): the one module of a format that imports torch."""
    return module.startswith("ckptkit.formats.") and module.endswith(".torch")


def test_formats_never_imports_torch() -> None:
    formats = sorted(m for m in MODULES if m.startswith(("ckptkit.formats", "ckptkit.io")) and not _torch_half(m))
    assert len(formats) > 10
    script = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in formats)
    script += "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(GRAPH[m][0]):
            if dep not in GRAPH:
                continue
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, m, dep])
            if dep not in state:
                walk(dep, [*path, m])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            walk(m, [])


# The layers, bottom up, by folder (CONTRIBUTING's "Architecture" section draws the same tree):
# each folder imports only its own layer and those below. A new folder must be placed here.
LAYERS: dict[str, int] = {
    "ckptkit.errors": 0,
    "ckptkit.io": 1,
    "ckptkit.formats": 2,
    "ckptkit.model": 3,
    "ckptkit.prefix": 3,
    "ckptkit.distributed": 3,
    "ckptkit.training": 3,
    "ckptkit.ops": 4,
    "ckptkit": 5,
    "ckptkit.cli": 6,
    "ckptkit.train": 6,
}
TOP_LEVEL_MODULES = 8  # at most this many modules directly in src/ckptkit/; the rest live in folders by role


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top


def _layer(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in LAYERS:
            return LAYERS[".".join(parts[:i])]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and README's Architecture table)")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_imports_upward(module: str) -> None:
    top, inner, _ = GRAPH[module]
    upward = sorted(m for m in top | inner if m in GRAPH and _layer(m) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports {upward} from above"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(("ckptkit.formats", "ckptkit.io"))))
def test_formats_imports_only_formats_and_errors(module: str) -> None:
    top, inner, torch = GRAPH[module]
    assert not torch or _torch_half(module)
    assert {
        m for m in top | inner if m.startswith("ckptkit") and not m.startswith(("ckptkit.formats", "ckptkit.io"))
    } <= {"ckptkit.errors"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ckptkit.io")))
def test_io_knows_no_format(module: str) -> None:
    top, inner, _ = GRAPH[module]
    assert {m for m in top | inner if m.startswith("ckptkit") and not m.startswith("ckptkit.io")} <= {"ckptkit.errors"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, "ckptkit.cli", "ckptkit.train")))
def test_cli_and_trainer_use_only_the_public_api(module: str) -> None:
    top, inner, _ = GRAPH[module]
    own = ("ckptkit.cli", "ckptkit.train")
    assert {m for m in top | inner if m.startswith("ckptkit") and not _within(m, *own)} <= PUBLIC


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _within(m, "ckptkit.cli", "ckptkit.train")))
def test_the_library_never_imports_its_clients(module: str) -> None:
    top, inner, _ = GRAPH[module]  # (also implied by the layers; said on its own for the message)
    assert not {m for m in top | inner if _within(m, "ckptkit.cli", "ckptkit.train")}


# Function-level imports of other packages, and why they may wait.
DEFERRED = {
    "rich": "the CLI and the trainer start, print --help and fail fast without it",
    "numpy": "optional: ckptkit runs without it",
    "fsspec": "the optional extra ckptkit[s3]: imported only when a URL is given",
    "botocore": "s3fs's, from the same extra: read only when an s3:// URL is given",
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_function_level_imports_only_defer_torch(module: str) -> None:
    _, inner, _ = GRAPH[module]
    not_deferring = sorted(
        m for m in inner if m.split(".")[0] not in ("torch", *DEFERRED) and not (m in GRAPH and _imports_torch(m))
    )
    assert not not_deferring, f"{module} imports {not_deferring} inside a function, but they do not import torch"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 600, (
        "split it by concept: a module holds one concept (a few hundred lines)"
    )


_FORMAT_NAMES = {"ZIP", "LEGACY", "SAFETENSORS", "DCP", "HF", "DEEPSPEED"}  # the formats' detect.py names


def _names_a_format(node: ast.AST) -> bool:
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in _FORMAT_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_format(e) for e in node.elts)
    return False


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _within(m, "ckptkit.formats", "ckptkit.io")))
def test_outside_formats_nothing_branches_on_a_format(module: str) -> None:
    """The operations ask the registry (a format's facts and verbs), never compare a format's name:
    a new format then touches its own package and the registry only."""
    tree = ast.parse(MODULES[module].read_text())
    branches = [
        f"line {node.lineno}: {ast.unparse(node)[:80]}"
        for node in ast.walk(tree)
        if (isinstance(node, ast.Compare) and any(_names_a_format(n) for n in [node.left, *node.comparators]))
        or (isinstance(node, ast.Dict) and any(k is not None and _names_a_format(k) for k in node.keys))
    ]
    assert not branches, branches


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _within(m, "ckptkit.io")))
def test_paths_and_urls_are_told_apart_in_the_store_only(module: str) -> None:
    """io.store.locate resolves a path or URL once, at the API's edge; nothing else asks is_url."""
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(MODULES[module].read_text()))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == "is_url" or getattr(node.func, "attr", None) == "is_url")
    ]
    assert not calls, f"{module} calls is_url on lines {calls}: use ckptkit.io.store.locate"


def test_each_format_detects_itself() -> None:
    """A format's detection rule is its package's ``detect.py``; the walk over them (formats.detect)
    imports no format, so a new format touches its own package and the registry line only."""
    from ckptkit.formats.registry import FORMATS

    for fmt in FORMATS.values():
        assert fmt.signature.matches.__module__ == f"{fmt.package}.detect", fmt.name
    walk = {m for m in GRAPH["ckptkit.formats.detect"][0] if m.startswith("ckptkit.formats")}
    assert not walk, f"formats.detect imports {sorted(walk)}: it must know no format"
