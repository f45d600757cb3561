"""Goodput under chaos, as a ratio to a fault-free run of the same data on the same fleet.

The fleet and the fault schedule are `tests/faults/chaos.py`'s: a private redis-server (AOF
on), moto S3 behind a proxy that can be cut, the control worker and two GPU workers with
emulator engines; a seeded schedule of worker SIGKILLs, engine SIGKILLs and SIGSTOPs, Redis
client kills, one Redis restart and S3 outages. The same fleet first runs the data without
faults, then a second copy of it (other ids) under the schedule; both must end with every
prompt exactly once and no batch parked. Goodput is prompts exported per second of wall time,
from enqueue to the last output object.

    python bench/chaos.py            # 1,800 prompts, 160 s of faults
    python bench/chaos.py --quick    # the test's soak: 900 prompts, 80 s of faults, seed 4

Every engine keeps a request log (`tests/faults/resends.py`), so the prompts the chaos run sent
to an engine again are printed per fault that caused them.

The last line is `goodput_vs_clean: R`, chaos goodput over clean goodput.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.chaos import fleet, soak_run  # noqa: E402
from tests.faults.resends import Sends, attribute, log_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test's soak (about 5 min)")
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args()
    prompts, duration_s = (900, 80.0) if args.quick else (1800, 160.0)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="genfleet-chaos-bench-"))

    def request_log(hostname: str) -> dict[str, str]:
        return {"GENFLEET_EMULATOR_REQUEST_LOG": str(root / log_name(hostname))}

    with fleet(root, extra_env=request_log) as soak:
        clean = soak_run(soak, "clean", prompts, None, 0.0, deadline_s=600.0)
        sends = Sends(root)
        sends.read()  # the clean run's sends: both runs send the same texts
        before = {text: len(sent) for text, sent in sends.by_prompt.items()}
        print(
            f"clean: {clean.prompts} prompts in {clean.seconds:.1f} s "
            f"({clean.prompts_per_s:.2f} prompts/s)",
            flush=True,
        )
        chaos = soak_run(soak, "chaos", prompts, args.seed, duration_s, deadline_s=900.0)
        print(
            f"chaos (seed {args.seed}): {chaos.prompts} prompts in {chaos.seconds:.1f} s "
            f"({chaos.prompts_per_s:.2f} prompts/s) through {len(chaos.actions)} faults: "
            f"{', '.join(chaos.actions)}",
            flush=True,
        )
        sends.read()
        chaotic = [sent[before.get(text, 0) :] for text, sent in sends.by_prompt.items()]
        redone = attribute(chaotic, soak.played)
        print(f"prompts sent again, by cause: {dict(redone.most_common())}", flush=True)
    print(f"goodput_vs_clean: {chaos.prompts_per_s / clean.prompts_per_s:.3f}")


if __name__ == "__main__":
    main()
