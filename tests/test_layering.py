"""The layering the design promises, checked on the source.

- producer never imports workers, but for the root CLI loading the GPU side's commands
  (`genfleet.workers.cli`) when one runs; common imports neither, nor Celery or GPU libraries;
- heavy libraries stay in their seam modules;
- no import cycle between modules, lazy (function-level) imports included;
- no folder holds more than ten modules, no module more than 450 lines;
- every package folder is listed in pyproject's `packages` under its `genfleet.` name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "workers")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "genfleet." + ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def imported_names(path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            # `from genfleet.x import y` may import the module genfleet.x.y
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# The one lazy import of workers by producer: the root CLI loads the GPU side's commands.
GPU_COMMANDS_SEAM = ("producer/cli.py", "genfleet.workers.cli")


def imports_of(package: str) -> dict[str, set[str]]:
    """Top-level names imported by each file of `package` (`genfleet.workers` → `workers`)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tops = set()
        for name in imported_names(path):
            seam_path, seam_module = GPU_COMMANDS_SEAM
            seam = str(path.relative_to(ROOT)) == seam_path
            if seam and (name + ".").startswith(seam_module + "."):
                continue
            parts = name.split(".")
            tops.add(parts[1] if parts[0] == "genfleet" and len(parts) > 1 else parts[0])
        found[str(path.relative_to(ROOT))] = tops
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("producer", {"workers", "pynvml", "sglang", "aiohttp", "prometheus_client"}),
        ("common", {"workers", "producer", "celery", "kombu", "pynvml", "sglang", "torch"}),
    ],
)
def test_package_does_not_import(package: str, forbidden: set[str]) -> None:
    bad = {path: names & forbidden for path, names in imports_of(package).items()}
    assert {path: names for path, names in bad.items() if names} == {}


def test_the_cli_seam_is_lazy_and_light() -> None:
    """`genfleet`'s producer commands load no worker module; listing the GPU side's commands
    loads `genfleet.workers.cli` alone, without Celery, the engine or NVML."""
    path, module = GPU_COMMANDS_SEAM
    tree = ast.parse((ROOT / path).read_text())
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert module not in top_level
    probe = (
        "import sys\n"
        "import genfleet.producer.cli as cli\n"
        "assert not [m for m in sys.modules if m.startswith('genfleet.workers')], 'eager'\n"
        "from typer.testing import CliRunner\n"
        "result = CliRunner().invoke(cli.app, ['--help'])\n"
        "assert result.exit_code == 0 and 'worker' in result.output, result.output\n"
        "heavy = {'celery', 'aiohttp', 'pynvml', 'genfleet.workers.app'} & set(sys.modules)\n"
        "assert 'genfleet.workers.cli' in sys.modules and not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_nothing_generic_is_imported_at_the_top() -> None:
    generic = {path: names & set(PACKAGES) for path, names in imports_of("workers").items()}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name in imported_names(path):
                assert name.split(".")[0] not in PACKAGES, f"{path}: import {name}"
    assert generic  # the walk saw the files


def test_gpu_and_engine_libraries_stay_in_their_seams() -> None:
    seams = {
        "pynvml": {"workers/observe/telemetry.py"},
        "sglang": set(),  # never imported: its version is read from package metadata
        "aiohttp": {p for p in imports_of("workers") if p.startswith("workers/engine/emulator/")}
        | {"workers/client.py"},
    }
    for library, allowed in seams.items():
        users = {path for path, names in imports_of("workers").items() if library in names}
        assert users <= allowed, f"{library} imported outside its seam: {users - allowed}"


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in source_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported in imported_names(path):
            if imported in modules and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_rooms_are_not_crowded() -> None:
    for folder in {p.parent for p in source_files()}:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 10, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"


def test_modules_are_short() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in source_files()
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert long == {}


def test_every_package_is_installed_under_genfleet() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {module_name(p) for p in source_files() if p.name == "__init__.py"}
    assert listed == folders
    assert config["tool"]["setuptools"]["package-dir"] == {f"genfleet.{p}": p for p in PACKAGES}
