"""Faults across two hosts, measured: how long a silent node's batches wait, and what it costs.

The fleet is `harness/multinode.py`'s: node 1 (the root namespace: Redis with a password, moto
S3, the control worker, one GPU worker) and node 2 (a network namespace behind a veth: one GPU
worker reaching Redis and S3 over the link), emulator engines, a 4 s lease, a 1 s reaper. Each
scenario plays one fault once node 2 runs batches and checks the export: every prompt exactly
once, nothing parked, node 2's batches re-sent within 1.5 leases + 2 reaper beats (+2 s).

    sudo python bench/multinode.py            # each scenario 3 times, 600 prompts a run
    sudo python bench/multinode.py --quick    # once each, 300 prompts (what the tests play)

Scenarios: `cut` (node 2's link drops every packet past its lease, then heals), `lose` (link
cut, every process of node 2 SIGKILLed, veth down), `ahead`/`behind` (node 2's clock 10 min
off: a plain run, then a cut), `reaper-behind` (the control worker's clock 10 min behind, a
cut). Per run it prints: prompts and batches, duplicates and lost ids (0), node 2's batches at
the fault, seconds until the reaper re-sent them all and until node 1 held them all, batches
redone, node 2's late copies refused by the write-once put, and seconds from the heal until
node 2's worker answered again. The last lines are each fault's worst re-send time against
its bound.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.multinode import Figures, play, two_nodes  # noqa: E402
from harness.nodes import libfaketime, unavailable  # noqa: E402

# name → (the fleet's clocks, the faults played on one fleet, in order)
SCENARIOS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "cut": ({}, ("cut",)),
    "lose": ({}, ("lose",)),
    "ahead": ({"clock_offset_s": 600}, ("none", "cut")),
    "behind": ({"clock_offset_s": -600}, ("none", "cut")),
    "reaper-behind": ({"control_clock_offset_s": -600}, ("cut",)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="once each, 300 prompts")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    args = parser.parse_args()
    if why := unavailable():
        sys.exit(f"cannot run: {why}")
    repeat, prompts = (1, 300) if args.quick else (args.repeat, args.prompts)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="genfleet-multinode-bench-"))
    played: dict[str, list[Figures]] = {}
    for turn in range(repeat):
        for name in args.only or SCENARIOS:
            clocks, faults = SCENARIOS[name]
            if clocks and libfaketime() is None:
                print(f"{name}: skipped, libfaketime is not installed", flush=True)
                continue
            folder = root / f"{name}-{turn}"
            folder.mkdir()
            with two_nodes(folder, **clocks) as fleet:
                for fault in faults:
                    figures = play(fleet, fault, f"{fault}-{turn}", prompts)
                    played.setdefault(f"{name}/{fault}", []).append(figures)
                    print(f"{name:<13} {figures.line()}", flush=True)
    print("worst re-send per scenario (s, against its bound):")
    for name, runs in played.items():
        resent = [f.resent_s for f in runs if f.resent_s is not None]
        if resent:
            worst = max(resent)
            mean = sum(resent) / len(resent)
            print(f"  {name:<18} worst {worst:.1f}, mean {mean:.1f} of {runs[0].bound_s:.1f}")


if __name__ == "__main__":
    main()
