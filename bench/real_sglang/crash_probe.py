"""Which CUDA-graph setting keeps SGLang alive under genfleet's load (hybrid model, MTP, triton).

    python bench/real_sglang/crash_probe.py --model /tmp/m/q35 --out probe.json \
        --variant graphs=--cuda-graph-max-bs=256 --variant below=--cuda-graph-max-bs=128 \
        --variant nograph=--disable-cuda-graph [--deadline EPOCH_S]

Each variant is one engine start with genfleet's own argv for the checkpoint (the variant's
flags added through `--engine-extra-args`, which turns genfleet's own workaround off), under
genfleet's supervisor with no restart, then a saturating direct client at the worker's
in-flight count (cap x 1.25 + 4 = 324) for `--load-s`. Reported per variant: ready time,
whether the engine survived, the first RuntimeError in its log, and tokens/s while it lived.
A variant that would not finish before `--deadline` is skipped, not started.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from load import saturate

from genfleet.common.settings import Settings
from genfleet.workers.engine.kinds import engine_launch
from genfleet.workers.engine.preflight import checkpoint_arch
from genfleet.workers.engine.supervisor import EngineSupervisor

BASE = "--sampling-backend pytorch --grammar-backend none"
INFLIGHT = 324  # default_max_inflight(256)


def probe(model: str, label: str, flags: str, load_s: float, log_dir: Path) -> dict[str, Any]:
    settings = Settings(
        model=model,
        engine="sglang",
        attention_backend="triton",
        mem_fraction_static=0.6,
        engine_extra_args=f"{BASE} {flags}",
    )
    launch = engine_launch(settings, 30500, arch=checkpoint_arch(model))
    assert launch is not None
    log_path = log_dir / f"probe_{label}.log"
    supervisor = EngineSupervisor(
        launch, gpus="0", log_path=log_path, startup_timeout_s=360, restart_budget=0
    )
    result: dict[str, Any] = {"variant": label, "flags": flags, "argv": " ".join(launch.argv)}
    started = time.monotonic()
    try:
        supervisor.start()
    except Exception as exc:  # noqa: BLE001 - a variant that cannot start is a result too
        result.update(started=False, error=f"{type(exc).__name__}: {exc}"[:600])
        supervisor.stop()
        return result
    result["ready_s"] = round(time.monotonic() - started, 1)
    load = saturate(
        launch.base_url,
        model,
        INFLIGHT,
        max_tokens=256,
        duration_s=load_s,
        alive=lambda: supervisor.state == "ready",
    )
    time.sleep(2)
    result["survived"] = supervisor.state == "ready"
    result["state"] = supervisor.state
    result["load"] = load
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    errors = re.findall(r"^.*(?:RuntimeError|Error:).*$", text, re.M)
    result["first_error"] = errors[0][:400] if errors else None
    graphs = re.findall(r"^.*[Cc]apture cuda graph.*$", text, re.M)
    result["graph_lines"] = [g[:200] for g in graphs[-2:]]
    supervisor.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", action="append", required=True, help="label=flags")
    parser.add_argument("--load-s", type=float, default=40.0)
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds")
    parser.add_argument("--need-s", type=float, default=150.0, help="time one variant needs")
    args = parser.parse_args()
    out = Path(args.out)
    results = []
    for item in args.variant:
        label, _, flags = item.partition("=")
        flags = flags.replace("=", " ")
        if args.deadline and time.time() + args.need_s > args.deadline:
            results.append({"variant": label, "flags": flags, "skipped": "no time left"})
            continue
        results.append(probe(args.model, label, flags, args.load_s, out.parent))
        print(json.dumps(results[-1])[:1500], flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
