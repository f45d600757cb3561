"""The layering the design promises, beyond what import-linter's contracts in pyproject.toml
check (`lint-imports`, run by the test command):

- the root CLI loads the GPU side's commands only when one runs;
- no import cycle between modules, lazy (function-level) imports included;
- nothing is imported under a generic top-level name (`common`, `workers`);
- the wheel holds `genfleet` and every package folder under it, nothing else;
- no test or bench module imports a test module or a conftest: what tests share is in
  tests/support/ (helpers), conftest.py (fixtures, which pytest hands out) and tests/fakes/;
  the local fleet of real processes that tests and benches both run is harness/;
- nothing outside tests/ imports tests/: the packages, harness/, bench/ and the rest stand
  without it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "workers")


def test_the_cli_seam_is_lazy_and_light() -> None:
    """`genfleet`'s producer commands load no worker module; listing the GPU side's commands
    loads `genfleet.workers.cli` alone, without Celery, the engine or NVML."""
    tree = ast.parse((ROOT / "genfleet" / "cli.py").read_text())
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert "genfleet.workers.cli" not in top_level
    probe = (
        "import sys\n"
        "import genfleet.cli as cli\n"
        "assert not [m for m in sys.modules if m.startswith('genfleet.workers')], 'eager'\n"
        "from typer.testing import CliRunner\n"
        "result = CliRunner().invoke(cli.app, ['--help'])\n"
        "assert result.exit_code == 0 and 'worker' in result.output, result.output\n"
        "heavy = {'celery', 'aiohttp', 'pynvml', 'genfleet.workers.app'} & set(sys.modules)\n"
        "assert 'genfleet.workers.cli' in sys.modules and not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_no_import_cycle_between_modules() -> None:
    """Every direct import a → b, lazy ones included: b never leads back to a."""
    graph = grimp.build_graph("genfleet", cache_dir=None)
    cycles = [
        (module, imported)
        for module in sorted(graph.modules)
        for imported in sorted(graph.find_modules_directly_imported_by(module))
        if imported != module
        and not module.startswith(imported + ".")
        and not imported.startswith(module + ".")
        and graph.chain_exists(imported, module)
    ]
    assert cycles == []


def test_a_cycle_would_be_seen(tmp_path: Path) -> None:
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "__init__.py").write_text("")
    (tmp_path / "loop" / "a.py").write_text("def f():\n    from loop import b\n")
    (tmp_path / "loop" / "b.py").write_text("from loop import a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        graph = grimp.build_graph("loop", cache_dir=None)
    finally:
        sys.path.remove(str(tmp_path))
    assert graph.chain_exists("loop.b", "loop.a") and graph.chain_exists("loop.a", "loop.b")


def test_nothing_generic_is_imported_at_the_top() -> None:
    seen = 0
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    assert node.level == 0, f"{path}: relative import"
                    names = [node.module]
                for name in names:
                    seen += 1
                    assert name.split(".")[0] not in PACKAGES, f"{path}: import {name}"
    assert seen > 100  # the walk saw the files


def test_the_wheel_holds_genfleet_and_every_package_folder() -> None:
    found = set(find_packages(str(ROOT), include=["genfleet*"]))
    folders = {
        "genfleet." + ".".join(p.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for p in (ROOT / package).rglob("__init__.py")
    }
    assert found == {"genfleet", *folders}
    for package in PACKAGES:
        link = ROOT / "genfleet" / package
        assert link.is_symlink() and str(link.readlink()) == f"../{package}"


def imported_test_modules(root: Path) -> list[str]:
    """`path: module` for each import, lazy ones included, of a test module (`test_*`) or a
    conftest by a Python file under `root`/tests or `root`/bench."""
    found = []
    for path in sorted([*(root / "tests").rglob("*.py"), *(root / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if name.split(".")[0] == "tests" and (
                    last.startswith("test_") or last == "conftest"
                ):
                    found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_no_test_module_imports_another() -> None:
    assert imported_test_modules(ROOT) == []


def test_an_import_of_a_test_module_would_be_seen(tmp_path: Path) -> None:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests" / "e2e" / "test_a.py").write_text(
        "from tests.e2e.test_b import helper\n"
        "def test_x():\n    from tests.e2e import test_c as c\n"
    )
    (tmp_path / "tests" / "e2e" / "test_d.py").write_text("import tests.support\n")
    (tmp_path / "bench" / "b.py").write_text("from tests.compose.conftest import Stack\n")
    assert imported_test_modules(tmp_path) == [
        "bench/b.py: tests.compose.conftest",
        "tests/e2e/test_a.py: tests.e2e.test_b",
        "tests/e2e/test_a.py: tests.e2e.test_c",
    ]


def imports_of_tests(root: Path) -> list[str]:
    """`path: module` for each import of `tests` (lazy ones included) by a Python file under
    `root` but outside `root`/tests (hidden folders left out)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == "tests" or any(part.startswith(".") for part in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "tests"]
    return found


def test_nothing_outside_tests_imports_tests() -> None:
    assert imports_of_tests(ROOT) == []


def test_an_import_of_tests_from_outside_would_be_seen(tmp_path: Path) -> None:
    for folder in ("bench", "common", "genfleet", "tests", ".venv"):
        (tmp_path / folder).mkdir()
    (tmp_path / "bench" / "b.py").write_text("from tests.support.waits import wait_for\n")
    (tmp_path / "common" / "c.py").write_text("def f():\n    import tests.fakes.engine, json\n")
    (tmp_path / "genfleet" / "g.py").write_text("from tests import support\nfrom . import tests\n")
    (tmp_path / "tests" / "t.py").write_text("from tests.support.core import batch\n")
    (tmp_path / ".venv" / "v.py").write_text("import tests\n")
    assert imports_of_tests(tmp_path) == [
        "bench/b.py: tests.support.waits",
        "common/c.py: tests.fakes.engine",
        "genfleet/g.py: tests",
    ]
