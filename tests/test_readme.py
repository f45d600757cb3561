"""README lists the code as it is: one row of its CLI table per command of the CLI itself, every
module of the three packages named in its map, and no path in README or docs/ that the tree
lacks. A new command or module fails here until README names it; a renamed one, until README
stops naming the old name."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import typer
from typer.core import TyperGroup

from genfleet.cli import app

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "producer", "workers")
# A path README or docs name: from a top folder of the repository, down to a word.
PATH = re.compile(r"(?<![\w/.-])((?:common|producer|workers|tests|bench|genfleet)/[\w/.-]*\w)(\*?)")


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    """The text of the `## title` section, up to the next section of the same level."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def cli_commands() -> list[str]:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return list(group.list_commands(typer.Context(group)))


def table_commands(text: str) -> Counter[str]:
    """The command each row of the CLI table is about: the word after `genfleet`."""
    rows = [
        line for line in section(text, "The CLI at a glance").splitlines() if line.startswith("| `")
    ]
    return Counter(row.split("`")[1].split()[1] for row in rows)


def module_map(text: str) -> dict[str, str]:
    """The map in "Where things are": each entry (a line that starts at the left margin) and
    the indented lines that follow it, keyed by the entry's first word."""
    block = section(text, "Where things are").split("```")[1]
    entries: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            key = line.split()[0].rstrip(",")
            entries[key] = line
        elif key:
            entries[key] += "\n" + line
    return entries


def package_modules() -> list[Path]:
    return sorted(
        path.relative_to(ROOT).with_suffix("")
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    )


def is_named(module: Path, entries: dict[str, str]) -> bool:
    """Named by its path (`workers/batch`), or by its name in the entry of its folder
    (`workers/engine/  … supervision (supervisor) …`)."""
    text = "\n".join(entries.values())
    if re.search(rf"(?<![\w/]){re.escape(module.as_posix())}(?![\w/])", text):
        return True
    folder = f"{module.parent.as_posix()}/"
    return any(
        key == folder and re.search(rf"(?<![\w/]){re.escape(module.name)}(?!\w)", entry)
        for key, entry in entries.items()
    )


def test_the_cli_table_has_one_row_per_command() -> None:
    rows = table_commands(readme())
    commands = cli_commands()
    assert len(commands) == len(set(commands)) > 10
    assert sorted(rows) == sorted(commands), "README's CLI table and the CLI differ"
    assert [name for name, count in rows.items() if count > 1] == []


def test_the_module_map_names_every_module() -> None:
    entries = module_map(readme())
    modules = package_modules()
    assert len(modules) > 50
    missing = [m.as_posix() for m in modules if not is_named(m, entries)]
    assert missing == [], f"README's map of the tree does not name {missing}"


def test_the_module_map_names_no_module_that_is_gone() -> None:
    entries = module_map(readme())
    gone = [
        key
        for key in entries
        if "/" in key and not ((ROOT / key).exists() or (ROOT / f"{key}.py").exists())
    ]
    assert gone == []


def exists(path: str) -> bool:
    """A file or folder of the tree, or a module (`.py` left out), or a name in one (its
    path followed by `.name`, as in `workers/batch.execute`)."""
    parts = path.split(".")
    candidates = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    return any((ROOT / c).exists() or (ROOT / f"{c}.py").exists() for c in candidates)


def test_every_path_readme_and_docs_name_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    absent = []
    for doc in docs:
        for path, glob in set(PATH.findall(doc.read_text(encoding="utf-8"))):
            found = any(ROOT.glob(f"{path}*")) if glob else exists(path)
            if not found:
                absent.append(f"{doc.name}: {path}{glob}")
    assert absent == []


def test_is_named_reads_paths_and_folder_entries() -> None:
    entries = {
        "workers/batch": "workers/batch       one batch",
        "workers/engine/": "workers/engine/  supervision (supervisor), ports",
    }
    assert is_named(Path("workers/batch"), entries)
    assert is_named(Path("workers/engine/supervisor"), entries)
    assert is_named(Path("workers/engine/ports"), entries)
    assert not is_named(Path("workers/engine/watchdog"), entries)
    assert not is_named(Path("workers/batching"), entries)
    assert not is_named(Path("workers/tune/supervisor"), entries)


def shape_table(text: str) -> dict[str, list[str]]:
    """README's table of shapes: each row's cells after the shape, keyed by the shape."""
    lines = section(text, "Datasets and exports").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| shape | detected by"))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_table_of_shapes_says_what_the_readers_do() -> None:
    from genfleet.common.readers.shapes import READINGS, id_reading

    table = shape_table(readme())
    assert sorted(table) == sorted(READINGS)
    for shape, (prompt, system, answer) in READINGS.items():
        _, *said = table[shape] + [""] * (5 - len(table[shape]))
        assert said == [prompt, system, answer, id_reading(shape)], shape
