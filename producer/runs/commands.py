"""`genfleet runs`, `genfleet cancel RUN`, `genfleet delete RUN [--yes]`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated

import orjson
import typer

from genfleet.common.errors import GenfleetError
from genfleet.common.redis_conn import connect
from genfleet.common.store import store_of
from genfleet.producer.console import (
    Json,
    RedisUrl,
    S3Endpoint,
    StoreUrl,
    build_settings,
    console,
    fail,
    out,
)
from genfleet.producer.runs.lifecycle import cancel_run, delete_run, describe, list_runs

COLUMNS = ("run", "state", "model", "engine", "prompts", "done", "failed", "created")


def runs(
    json_out: Json = False,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
) -> None:
    """Every run in the store: state, model, engine, prompts, prompts done, failed batches,
    created."""
    settings = build_settings(redis_url=redis_url, store=store, s3_endpoint_url=s3_endpoint_url)
    try:
        objects = store_of(settings)
        rows = list_runs(objects, connect(settings))
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        out.print_json(orjson.dumps(rows).decode())
        return
    if not rows:
        out.print(f"no runs in {settings.store}", highlight=False)
        return
    table = [COLUMNS]
    for row in rows:
        created = row["created_at"]
        table.append(
            (
                row["run"],
                row["state"],
                str(row["model"] or "-"),
                str(row["engine"] or "-"),
                str(row["prompts"] if row["prompts"] is not None else "-"),
                str(row["done"]),
                str(row["failed"]),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "-",
            )
        )
    for line in fit_columns(table, out.width):
        out.print(line, highlight=False, soft_wrap=True)


def fit_columns(table: Sequence[tuple[str, ...]], width: int) -> list[str]:
    """The rows as aligned columns; where they are wider than the terminal, the model and
    engine (the longest cells: a path) go on a line of their own under each row, so that no
    row wraps and no cell is cut."""

    def lines(rows: Sequence[tuple[str, ...]]) -> list[str]:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]

    whole = lines(table)
    if max(map(len, whole)) <= width:
        return whole
    model, engine = COLUMNS.index("model"), COLUMNS.index("engine")
    narrow = [tuple(c for i, c in enumerate(row) if i not in (model, engine)) for row in table]
    out: list[str] = []
    for i, line in enumerate(lines(narrow)):
        out.append(line)
        if i:  # under each run: its model and engine
            out.append(f"    {table[i][model]} ({table[i][engine]})")
    return out


def cancel(
    run: Annotated[str, typer.Argument()],
    json_out: Json = False,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
) -> None:
    """Cancel RUN: no batch of it starts again; running ones stop, checkpoint and park.

    `genfleet enqueue --resume RUN` resumes it, from the checkpoints.
    """
    settings = build_settings(redis_url=redis_url, store=store, s3_endpoint_url=s3_endpoint_url)
    try:
        objects = store_of(settings)
        result = cancel_run(objects, connect(settings), run)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        out.print_json(orjson.dumps(result.to_json()).decode())
        return
    console.print(
        f"run {run}: {'was already ' if result.already else ''}cancelled; "
        f"{result.orders_removed} waiting orders removed; {len(result.running)} running "
        f"batches stop within seconds (checkpointed). Resume: genfleet enqueue --resume {run}",
        highlight=False,
    )


def delete(
    run: Annotated[str, typer.Argument()],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    json_out: Json = False,
    redis_url: RedisUrl = None,
    store: StoreUrl = None,
    s3_endpoint_url: S3Endpoint = None,
) -> None:
    """Delete RUN: its store objects (inputs, outputs, checkpoints, manifest), its work orders
    and its Redis keys. Running batches are cancelled and waited for first."""
    settings = build_settings(redis_url=redis_url, store=store, s3_endpoint_url=s3_endpoint_url)
    try:
        objects = store_of(settings)
        client = connect(settings)
        what = describe(objects, client, run)
        if not yes and not typer.confirm(f"Delete {what}?", default=False, err=True):
            fail("not deleted", code=1)
        result = delete_run(settings, objects, client, run)
    except (GenfleetError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        out.print_json(orjson.dumps(result.to_json()).decode())
        return
    console.print(
        f"run {run} deleted: {result.objects} store objects, {result.redis_keys} Redis keys, "
        f"{result.orders_removed} work orders",
        highlight=False,
    )
