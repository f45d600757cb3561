"""One owner per Redis key family: only the owner module names the family's key helper.

As arq's `Worker.finish_job` is the one writer of a job's result, each family below has one
module that writes and reads it, and every other module calls that module's functions (a write
that belongs to another transaction passes its pipeline). The check reads the syntax tree of
every module of the three packages: a call or any other use of the key helper, as
`keys.name(...)`, through an alias of `genfleet.common.keys` or imported by name, is found
wherever it is (a lazy import inside a function included); docstrings and log text are not
calls and do not count.

`genfleet delete` removes every per-run key, the run counters among them, by
`keys.run_keys_pattern` (producer/runs/lifecycle.py): a whole run goes, whoever owns its keys.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "workers")
KEYS_MODULE = "genfleet.common.keys"

# key helper (common/keys.py) → the one module that may name it
OWNERS = {
    "findings_key": "common/findings.py",
    "runs_key": "common/run_registry.py",
    "counters_key": "common/counters.py",
    "workers_key": "common/fleet_registry.py",
    "quality_window_key": "common/quality_gate.py",
    "quality_gate_key": "common/quality_gate.py",
    "paused_key": "common/quality_gate.py",
    "crash_evidence_key": "workers/crash_evidence.py",
    "drawn_journal_key": "workers/drawn_journal.py",
    "drawn_journal_tries_key": "workers/drawn_journal.py",
    "engine_alarms_key": "common/engine_alarms.py",
    "model_key": "common/model_identity.py",
    "model_refusals_key": "common/model_identity.py",
}


def _aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """The names bound to the keys module (`keys`, `k`, or a dotted `genfleet.common.keys`)
    and the local names of owned helpers imported from it (local name → helper)."""
    modules: set[str] = set()
    helpers: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == KEYS_MODULE:
                    modules.add(alias.asname or KEYS_MODULE)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" == KEYS_MODULE:
                    modules.add(alias.asname or alias.name)
                elif node.module == KEYS_MODULE and alias.name in OWNERS:
                    helpers[alias.asname or alias.name] = alias.name
    return modules, helpers


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def foreign_uses(source: str, path: str) -> list[str]:
    """`path:line: helper (owner: ...)` for each use of an owned key helper in the module at
    `path` (relative to the repository) that is not that helper's owner."""
    tree = ast.parse(source, path)
    modules, helpers = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        helper = None
        if isinstance(node, ast.Attribute) and node.attr in OWNERS:
            if _dotted(node.value) in modules:
                helper = node.attr
        elif isinstance(node, ast.Name) and node.id in helpers:
            helper = helpers[node.id]
        elif isinstance(node, ast.ImportFrom) and node.module == KEYS_MODULE:
            named = [a.name for a in node.names if a.name in OWNERS]
            helper = named[0] if named else None
        if helper is not None and OWNERS[helper] != path:
            found.append(f"{path}:{node.lineno}: keys.{helper} (owner: {OWNERS[helper]})")
    return sorted(set(found), key=lambda row: (row.split(":")[0], int(row.split(":")[1])))


def package_sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def test_each_key_family_has_one_owner() -> None:
    sources = package_sources()
    assert len(sources) > 50  # the walk saw the packages
    found = [row for path, text in sources.items() for row in foreign_uses(text, path)]
    assert found == [], "a key family named outside its owner:\n" + "\n".join(found)


def test_each_owner_names_its_family() -> None:
    """The table names modules that hold their key: an owner moved or renamed fails here."""
    sources = package_sources()
    for helper, owner in OWNERS.items():
        assert owner in sources, f"{owner} is gone"
        assert f"keys.{helper}(" in sources[owner], f"{owner} does not use keys.{helper}"


def test_every_way_of_naming_a_helper_is_seen() -> None:
    source = (
        "from genfleet.common import keys\n"
        "import genfleet.common.keys\n"
        "import genfleet.common.keys as k\n"
        "from genfleet.common import keys as kk\n"
        "from genfleet.common.keys import counters_key, runs_key as rk\n"
        "'''keys.findings_key() in a docstring is no call'''\n"
        "def f(client, run):\n"
        "    from genfleet.common.keys import workers_key\n"
        "    client.xadd(keys.findings_key(), {})\n"
        "    client.sadd(rk(), run)\n"
        "    client.hgetall(counters_key(run))\n"
        "    client.hdel(workers_key(), run)\n"
        "    client.srem(genfleet.common.keys.runs_key(), run)\n"
        "    client.get(k.counters_key(run)), client.get(kk.findings_key())\n"
        "    helper = keys.workers_key\n"
        "    client.hkeys(keys.done_key(run))\n"
        "    log.info('keys.runs_key() %s', run)\n"
    )
    lines = [int(row.split(":")[1]) for row in foreign_uses(source, "workers/x.py")]
    assert lines == [5, 8, 9, 10, 11, 12, 13, 14, 14, 15]
    owner = "from genfleet.common import keys\nkeys.counters_key('r')\n"
    assert foreign_uses(owner, "common/counters.py") == []
    assert foreign_uses(owner, "common/progress.py") == [
        "common/progress.py:2: keys.counters_key (owner: common/counters.py)"
    ]
