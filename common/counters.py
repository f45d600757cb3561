"""A run's live counters: one Redis hash of numbers that `status`, `top` and `report` show.

Each field is added to where the event it counts happens, by the process that saw it, and
never read back by a writer (the store stays the truth of what is done):

- `started_at`: set once, by the first batch of the run a worker starts (`mark_started`);
- `prompts_generated`, `tokens_generated`: what the GPUs produced, every progress interval,
  in the ledger's `progress` pipeline (`add_generated`);
- `errors`, `completion_tokens`, `reasoning_tokens`, where the tokens went
  (common/waste.py) and `last_done_at`: by the copy of a batch that wrote its output, in the
  ledger's `done` transaction (`add_done`); the late copies and what they threw away by a
  copy that found the output written by another, in its `done` transaction (`add_late_copy`);
- `prompts_done`: the prompts of the batches done, added in that same transaction by
  common/progress.py (`add_prompts_done`), by the reaper for a batch whose writer was lost
  before that transaction (`add_prompts_done_once`), and recomputed by its reconcile from the
  done hash (`recount_prompts_done`);
- `gpu_s`, `energy_*`: a batch's share of the GPUs' time and energy, once it settled
  (`add_energy`, workers/tasks.py).

A write that belongs to another transaction takes that transaction's pipeline. `genfleet
delete` removes the hash with every other key of the run (`keys.run_keys_pattern`,
producer/runs/lifecycle.py). Otherwise this module is the only code that touches the hash
(tests/test_key_owners.py holds it so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis

from genfleet.common import keys
from genfleet.common.redis_conn import RedisCommands, RedisPipeline, text

PROMPTS_DONE = "prompts_done"

# Recomputed server-side so that no worker's HSET + HINCRBY lands between the sum and the set.
_RESUM = """
local total = 0
for _, value in ipairs(redis.call('HVALS', KEYS[1])) do total = total + tonumber(value) end
redis.call('HSET', KEYS[2], ARGV[1], total)
return total
"""

# A batch into the done hash with its prompts, and those prompts into `prompts_done`, only if
# the hash did not hold it: the writer's transaction puts both or neither.
COUNT_ONCE_SCRIPT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], ARGV[2])
  return 1
end
return 0
"""


def mark_started(client: RedisCommands, run: str, now: float) -> None:
    """Called by a worker as it starts generating a batch: the run started at `now`, unless
    an earlier batch already said so."""
    client.hsetnx(keys.counters_key(run), "started_at", now)


def add_generated(pipe: RedisPipeline, run: str, prompts: int, tokens: int) -> None:
    """Queue, in the ledger's `progress` pipeline: a worker's running batches of `run`
    generated `prompts` and `tokens` since its last report."""
    pipe.hincrby(keys.counters_key(run), "prompts_generated", prompts)
    pipe.hincrby(keys.counters_key(run), "tokens_generated", tokens)


def add_done(
    pipe: RedisPipeline, run: str, counts: Iterable[tuple[str, int]], done_at: float
) -> None:
    """Queue, in the ledger's `done` transaction of the copy that wrote a batch's output:
    add each (field, count) of the batch, in order, and stamp `last_done_at`."""
    _add(pipe, run, counts)
    pipe.hset(keys.counters_key(run), "last_done_at", done_at)


def add_late_copy(pipe: RedisPipeline, run: str, counts: Iterable[tuple[str, int]]) -> None:
    """Queue, in the ledger's `done` transaction of a copy that found the batch's output
    written by another: add each (field, count), what it threw away (common/waste.py). No
    `last_done_at`: the batch was done when the other copy wrote it."""
    _add(pipe, run, counts)


def _add(pipe: RedisPipeline, run: str, counts: Iterable[tuple[str, int]]) -> None:
    name = keys.counters_key(run)
    for field, count in counts:
        pipe.hincrby(name, field, count)


def add_prompts_done(pipe: RedisPipeline, run: str, prompts: int) -> None:
    """Queue, in the transaction that marks a batch written (common/progress.py): its
    prompts are done."""
    pipe.hincrby(keys.counters_key(run), PROMPTS_DONE, prompts)


def prompts_done(client: redis.Redis, run: str) -> int:
    """`prompts_done` as it stands (0 when unset)."""
    return int(client.hget(keys.counters_key(run), PROMPTS_DONE) or 0)


def add_prompts_done_once(
    client: RedisCommands, run: str, done_hash: str, batch: str, prompts: int
) -> bool:
    """In one script: the batch into `done_hash` (the run's done hash) with its `prompts`, and
    those into `prompts_done`, unless the hash holds the batch already (its writer counted
    it); True when this call counted it."""
    added = client.eval(
        COUNT_ONCE_SCRIPT, 2, done_hash, keys.counters_key(run), batch, str(prompts), PROMPTS_DONE
    )
    return bool(added)


def recount_prompts_done(client: redis.Redis, run: str, done_hash: str) -> int:
    """Set `prompts_done` to the sum of the values of `done_hash` (the run's done hash, batch
    → prompts) in one script, so no batch marked meanwhile is lost; returns the sum."""
    return int(client.eval(_RESUM, 2, done_hash, keys.counters_key(run), PROMPTS_DONE))


def add_energy(
    client: RedisCommands, run: str, gpu_s: float, tokens: int, energy_j: float | None
) -> None:
    """Called once a batch settled: its share of the GPUs' time, and of their energy where
    they had an energy counter, with the `tokens` generated for it (one transaction)."""
    pipe = client.pipeline()
    name = keys.counters_key(run)
    pipe.hincrbyfloat(name, "gpu_s", gpu_s)
    pipe.hincrby(name, "energy_tokens", tokens)
    if energy_j is not None:
        pipe.hincrbyfloat(name, "energy_j", energy_j)
        pipe.hincrby(name, "energy_batches", 1)
        pipe.hincrby(name, "energy_batch_tokens", tokens)
    pipe.execute()


def queue_read(pipe: redis.Redis, run: str) -> None:
    """Queue the hash's read in a reader's pipeline (`progress.snapshot`'s one round trip);
    its reply goes through `decode`."""
    pipe.hgetall(keys.counters_key(run))


def decode(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def read(client: redis.Redis, run: str) -> dict[str, str]:
    """Every counter of `run`, as text (one HGETALL)."""
    return decode(client.hgetall(keys.counters_key(run)))
