"""The quality gate's state in Redis: a run's window of last answers, its gate settings and
the verdict that paused it. The decision itself is `common/quality.judge` (pure).

When, and who:

- `record_settings`: by each enqueue of the run (`enqueue`, `run`, `--resume`), with the
  enqueuer's `quality_gate*` settings; workers judge the run by these (`settings_of`), so
  `--no-quality-gate` on the command that enqueues turns the gate off for that run;
- `add_window`: by the copy of a batch that wrote its output, right after the ledger's `done`
  transaction added its tally to the run counters (common/counters.py): a ring of
  `window_answers` slots (each batch holds at least one answer), so the newest batches that
  hold `window_answers` answers are always there;
- `read_window` and `pause`: by that worker right after (workers/batch.py): the newest
  entries that hold `window_answers` answers are judged; a run that trips is paused: the
  verdict is set once, with the run's cancelled flag in the same transaction, so its orders
  are held exactly as `genfleet cancel` holds them (running batches checkpoint and park,
  waiting orders are parked as they come, nothing is lost or done twice); the verdict says
  why, with the fix, to `status` and `run`;
- `resume`: by the next enqueue of the run, before it clears the cancelled flag: the verdict
  and the window go, so the resumed run is judged on its new answers only.

Each read or write is a few commands whatever the run's size: the window is bounded by its
setting. Nothing here compares clocks: the window counts answers, not time. `genfleet delete`
removes these keys with the run's others (`keys.run_keys_pattern`). This module is the only
code that names them (tests/test_key_owners.py).
"""

from __future__ import annotations

from typing import Any

import orjson

from genfleet.common import keys
from genfleet.common.ledger import Ledger
from genfleet.common.quality import GateSettings, QualityTally, Verdict
from genfleet.common.redis_conn import RedisCommands, text


def record_settings(client: RedisCommands, run: str, settings: GateSettings) -> None:
    client.set(keys.quality_gate_key(run), orjson.dumps(settings.to_json()))


def settings_of(client: RedisCommands, run: str, default: GateSettings) -> GateSettings:
    """The run's gate settings as its last enqueue recorded them; `default` (the worker's
    own) for a run enqueued by an older genfleet."""
    raw = client.get(keys.quality_gate_key(run))
    return default if raw is None else GateSettings.from_json(orjson.loads(raw))


def add_window(client: RedisCommands, run: str, tally: QualityTally, keep: int) -> None:
    """The batch's tally enters the window: a ring of `keep` slots in one hash, each slot
    holding its sequence number, so the newest are known without a list (two commands)."""
    name = keys.quality_window_key(run)
    seq = int(client.hincrby(name, "seq", 1))
    entry = {"seq": seq, **tally.to_counters()}
    client.hset(name, f"s{seq % max(keep, 1)}", orjson.dumps(entry))


def read_window(client: RedisCommands, run: str, answers: int) -> QualityTally:
    """The newest batches' tallies that hold at least `answers` answers (all when fewer)."""
    entries = [
        orjson.loads(value)
        for field, value in client.hgetall(keys.quality_window_key(run)).items()
        if text(field) != "seq"
    ]
    window = QualityTally()
    for entry in sorted(entries, key=lambda e: -int(e.pop("seq"))):
        window.merge(QualityTally.from_counters(entry))
        if window.answers >= answers:
            break
    return window


def pause(client: RedisCommands, run: str, verdict: Verdict, worker: str, now: float) -> bool:
    """Pause `run` on `verdict`: the verdict kept for `status` and `run` (set once), then the
    run's cancelled flag, so its orders are held as `cancel` holds them. False when the run
    was already paused."""
    record = {**verdict.to_json(), "worker": worker, "paused_at": now}
    if not client.hsetnx(keys.paused_key(run), "verdict", orjson.dumps(record)):
        return False
    Ledger(client).hold(run, now)
    return True


def paused(client: RedisCommands, run: str) -> dict[str, Any] | None:
    """The verdict that paused `run`, or None."""
    raw = client.hget(keys.paused_key(run), "verdict")
    return None if raw is None else dict(orjson.loads(raw))


def resume(client: RedisCommands, run: str) -> dict[str, Any] | None:
    """Clear the pause and the window (the resumed run is judged afresh); the verdict that
    paused it, or None when it was not paused."""
    verdict = paused(client, run)
    client.delete(keys.paused_key(run), keys.quality_window_key(run))
    return verdict
