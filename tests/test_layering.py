"""The layering the design promises, checked on the source: producer never imports workers,
common never imports Celery or GPU libraries, and heavy imports stay in their seam modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports_of(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
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


def test_gpu_and_engine_libraries_stay_in_their_seams() -> None:
    seams = {
        "pynvml": {"workers/telemetry.py"},
        "sglang": set(),  # never imported: its version is read from package metadata
        "aiohttp": {p for p in imports_of("workers") if p.startswith(("workers/engine/emulator/",))}
        | {"workers/client.py"},
    }
    for library, allowed in seams.items():
        users = {path for path, names in imports_of("workers").items() if library in names}
        assert users <= allowed, f"{library} imported outside its seam: {users - allowed}"
