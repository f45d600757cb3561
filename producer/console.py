"""What the producer's commands share: the consoles, common options, the settings built from
flags and the one error exit (`genfleet.common.flags.fail`, re-exported)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from genfleet.common.flags import fail
from genfleet.common.settings import Settings

__all__ = ["Json", "RedisUrl", "S3Endpoint", "StoreUrl", "build_settings"]
__all__ += [
    "console",
    "fail",
    "format_eta",
    "out",
    "plural",
    "print_read_as",
    "print_rejects",
    "warn_unread",
]

console = Console(stderr=True)
out = Console()

RedisUrl = Annotated[str | None, typer.Option("--redis-url", help="GENFLEET_REDIS_URL")]
StoreUrl = Annotated[
    str | None, typer.Option("--store", help="s3://bucket/prefix or file:///path (GENFLEET_STORE)")
]
S3Endpoint = Annotated[
    str | None, typer.Option("--s3-endpoint-url", help="GENFLEET_S3_ENDPOINT_URL (MinIO, ...)")
]
Json = Annotated[bool, typer.Option("--json", help="one JSON object on stdout")]
SystemCol = Annotated[str | None, typer.Option(help="the system prompt's field or column")]
AnswerCol = Annotated[
    str | None, typer.Option(help="the old answer's field or column (with --regenerate)")
]
FirstTurn = Annotated[
    bool,
    typer.Option("--first-turn", help="MT-bench-style `turns`: ask each row's first turn alone"),
]


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 batch`, `3 batches`, `43,586 tokens`: counts as a person writes them."""
    return "1 " + word if count == 1 else f"{count:,} {many or word + 's'}"


def format_eta(eta_s: float | None) -> str:
    """h:mm:ss, the one format of ETAs and durations on the terminal (`-` when unknown)."""
    if eta_s is None:
        return "-"
    minutes, seconds = divmod(max(int(round(eta_s)), 0), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def print_rejects(samples: list[str]) -> None:
    """One line per rejected input line, escaped: `p.jsonl:269 [prompt]: …` keeps its field
    (rich would read `[prompt]` as markup and drop it)."""
    for line in samples:
        console.print(f"  [yellow]rejected[/] {escape(line)}", highlight=False)


def print_read_as(readings: list[str]) -> None:
    """One line per file read: the shape it was read as and where each part came from (the
    user sees what genfleet made of the data before the run's answers do)."""
    for line in readings:
        console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


def warn_unread(run: str, sources: list[str], rows: int) -> None:
    """A source not read to its end: the run holds less than the source, whatever it counts."""
    if sources:
        lost = f"{rows:,} rows" if rows else "rows"
        console.print(
            f"[bold red]warning:[/] run {run}: {lost} of {', '.join(map(escape, sources))} "
            f"were not read (refused whole or corrupt mid-file; see {run}/rejects.jsonl): "
            "the run holds less than its source",
            highlight=False,
        )


def build_settings(**flags: Any) -> Settings:
    """Environment + defaults, overridden by the flags given (not None)."""
    try:
        return Settings.from_overrides({k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:
        fail(str(exc).replace("\n", " "))
