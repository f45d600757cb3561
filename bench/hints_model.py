"""What length hints can buy at best: list scheduling of one run on a pool of slots.

A model, not a measurement of genfleet: `slots` identical slots each take the next prompt of
one list when they free up (an ideal dispatcher); prompt lengths are the emulator's lognormal
(mean 1,800 tokens, sigma 0.9, the 8,192 cap) and a hint is correlated with the log length at
`rho`. `tail` is the makespan minus the moment 10 % of the slots stood idle (as `tail_s` in
`bench/fleet.py`), in token-times. Orders compared: input order (no hints); genfleet's batch
order (contiguous batches sent by their longest hint, each longest-first); and every prompt by
its hint (what batches that are not contiguous in input order would allow).

    python bench/hints_model.py --rho 0.6
"""

from __future__ import annotations

import argparse
import heapq
import math
import random


def schedule(lengths: list[float], order: list[int], slots: int) -> tuple[float, float]:
    """(makespan, tail) of `order` on `slots` slots."""
    free = [0.0] * slots
    for i in order:
        heapq.heappush(free, heapq.heappop(free) + lengths[i])
    idle = sorted(free)
    return idle[-1], idle[-1] - idle[int(slots * 0.1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rho", type=float, default=0.6)
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--draws", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(1)
    mu = math.log(1800) - 0.9**2 / 2
    totals: dict[str, list[float]] = {
        "input order": [0, 0],
        "batch order": [0, 0],
        "by prompt": [0, 0],
    }
    for _ in range(args.draws):
        z = [rng.gauss(0, 1) for _ in range(args.prompts)]
        lengths = [min(8192.0, math.exp(mu + 0.9 * x)) for x in z]
        hint = [args.rho * x + math.sqrt(1 - args.rho**2) * rng.gauss(0, 1) for x in z]
        order = list(range(args.prompts))
        batches = [order[k : k + args.batch_size] for k in range(0, args.prompts, args.batch_size)]
        batches.sort(key=lambda b: -max(hint[i] for i in b))
        orders = {
            "input order": order,
            "batch order": [i for b in batches for i in sorted(b, key=lambda i: -hint[i])],
            "by prompt": sorted(order, key=lambda i: -hint[i]),
        }
        for name, sequence in orders.items():
            makespan, tail = schedule(lengths, sequence, args.slots)
            totals[name][0] += makespan / args.draws
            totals[name][1] += tail / args.draws
    base = totals["input order"]
    for name, (makespan, tail) in totals.items():
        print(
            f"{name:>12}: makespan {makespan:,.0f}, tail {tail:,.0f} "
            f"({tail / base[1]:.2f} of input order's)"
        )


if __name__ == "__main__":
    main()
