"""summarize.py WORKDIR: phases x (engine tokens/s from /metrics, NVML power from the energy
counter, util, clocks, power-cap throttling) -> WORKDIR/summary.json, printed."""

import json
import statistics
import sys
from pathlib import Path

W = Path(sys.argv[1])


def rows(name):
    p = W / name
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def load(name):
    try:
        return json.loads((W / name).read_text())
    except Exception:
        return None


marks = {}
for line in (W / "phases.txt").read_text().splitlines():
    k, v = line.split()
    marks[k] = float(v)
power_all = rows("power.jsonl")
head = power_all[0] if power_all and "name" in power_all[0] else {}
power = [r for r in power_all if "w" in r]
metr = [r for r in rows("metrics.jsonl") if "sglang:generation_tokens_total" in r]


def interp(series, key, t):
    """Counter value at time t, linearly interpolated."""
    prev = None
    for r in series:
        if r["t"] >= t:
            if prev is None:
                return r[key]
            f = (t - prev["t"]) / max(1e-9, r["t"] - prev["t"])
            return prev[key] + f * (r[key] - prev[key])
        prev = r
    return prev[key] if prev else None


def window(t0, t1):
    if t1 <= t0:
        return None
    ps = [r for r in power if t0 <= r["t"] <= t1]
    out = {"t0": round(t0, 1), "s": round(t1 - t0, 1)}
    if ps:
        ws = sorted(r["w"] for r in ps)
        e0, e1 = interp(power, "e_mj", t0), interp(power, "e_mj", t1)
        lim = ps[-1]["lim"]
        mean_w = (e1 - e0) / 1000 / (t1 - t0) if e0 is not None else statistics.mean(ws)
        out.update(
            mean_w=round(mean_w, 1),
            pct_limit=round(100 * mean_w / lim, 1),
            limit_w=lim,
            p50_w=round(ws[len(ws) // 2], 1),
            p90_w=round(ws[int(len(ws) * 0.9)], 1),
            max_w=round(ws[-1], 1),
            util=round(statistics.mean(r["util"] for r in ps), 1),
            mem_util=round(statistics.mean(r["mutil"] for r in ps), 1),
            sm_mhz=round(statistics.mean(r["sm"] for r in ps)),
            powercap_share=round(sum(1 for r in ps if r["thr"] & 0x4) / len(ps), 2),
            mem_mib=max(r["mem_mib"] for r in ps),
        )
    if metr:
        g0 = interp(metr, "sglang:generation_tokens_total", t0)
        g1 = interp(metr, "sglang:generation_tokens_total", t1)
        ms = [r for r in metr if t0 <= r["t"] <= t1]
        out["engine_tokens"] = round(g1 - g0)
        out["engine_tok_s"] = round((g1 - g0) / (t1 - t0), 1)
        if ms:
            run = [r.get("sglang:num_running_reqs", 0) for r in ms]
            out["running_p50"] = sorted(run)[len(run) // 2]
            out["running_max"] = max(run)
            q = [r.get("sglang:num_queue_reqs", 0) for r in ms]
            out["queued_p50"] = sorted(q)[len(q) // 2]
            acc = [r["sglang:spec_accept_length"] for r in ms if "sglang:spec_accept_length" in r]
            if acc:
                out["accept_length"] = round(statistics.mean(acc), 3)
        gauge = [r["sglang:gen_throughput"] for r in ms if "sglang:gen_throughput" in r]
        if gauge:
            # The scheduler's own decode rate (tokens generated, finished or not): the
            # counter above moves only when requests finish.
            out["decode_tok_s"] = round(statistics.mean(gauge), 1)
        if out.get("mean_w") and out["engine_tok_s"]:
            out["j_per_token"] = round(out["mean_w"] / out["engine_tok_s"], 4)
    return out


def steady(t0, t1):
    """The part of [t0, t1] where the engine ran >= 90 % of the phase's most running requests."""
    ms = [r for r in metr if t0 <= r["t"] <= t1]
    if not ms:
        return None
    top = max(r.get("sglang:num_running_reqs", 0) for r in ms)
    full = [r["t"] for r in ms if r.get("sglang:num_running_reqs", 0) >= 0.9 * top]
    if len(full) < 2:
        return None
    return window(full[0], full[-1])


phases = {}
for k in marks:
    if k.endswith("_start"):
        name = k[: -len("_start")]
        if name + "_end" in marks:
            phases[name] = {
                "whole": window(marks[k], marks[name + "_end"]),
                "steady": steady(marks[k], marks[name + "_end"]),
            }
s = {"gpu": head, "phases": phases, "marks": marks}
if "engine_ready" in marks:
    s["engine_start_s"] = round(marks["engine_ready"] - marks["engine_start"], 1)
direct = load("direct.json")
gf = load("genfleet.json")
s["direct"], s["genfleet"] = direct, gf
if direct and gf and direct.get("tokens_per_s"):
    s["genfleet_vs_direct_end_to_end"] = round(gf["tokens_per_s"] / direct["tokens_per_s"], 3)
try:
    a, b = phases["direct"]["steady"]["decode_tok_s"], phases["gf"]["steady"]["decode_tok_s"]
    s["genfleet_vs_direct_steady_engine"] = round(b / a, 3)
except (KeyError, TypeError, ZeroDivisionError):
    pass


def live_rates():
    """(t, the engine's decode rate) at each /metrics sample: its gauge while it moves, 0 where
    no request runs and after the first sample of a value held for over STALE_S (the scheduler
    sets the gauge, and `num_running_reqs`, only when it logs a decode batch: an engine gone
    idle keeps reporting its last batch)."""
    rows = [r for r in metr if "sglang:gen_throughput" in r]
    out, i = [], 0
    while i < len(rows):
        j = i
        while (
            j + 1 < len(rows)
            and rows[j + 1]["sglang:gen_throughput"] == rows[i]["sglang:gen_throughput"]
        ):
            j += 1
        held = rows[j]["t"] - rows[i]["t"] > STALE_S
        for k in range(i, j + 1):
            r = rows[k]
            idle = r.get("sglang:num_running_reqs", 0) <= 0 or (held and k > i)
            out.append((r["t"], 0.0 if idle else r["sglang:gen_throughput"]))
        i = j + 1
    return out


STALE_S = 4.0
RATES = live_rates()


def engine_rate(t0, t1):
    """The engine's mean decode rate over (t0, t1] (`live_rates`)."""
    rates = [g for t, g in RATES if t0 < t <= t1]
    return statistics.mean(rates) if rates else None


def top_rows():
    """`genfleet top --once --json` rows from top.txt: (the sample's time, its row)."""
    p = W / "top.txt"
    if not p.exists():
        return []
    out, at = [], None
    for line in p.read_text().splitlines():
        if line.startswith("## t="):
            at = float(line[5:])
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        for r in row if isinstance(row, list) else [row]:
            if isinstance(r, dict) and "tokens_per_s" in r:
                out.append((float(r.get("ts") or at or 0), r))
    return out


# top's tok/s (tokens streamed over its window) against the engine's decode rate over the
# same seconds, idle ones counted as 0: one line per `top` call.
s["top_vs_engine"] = []
for t, r in top_rows():
    w = float(r.get("window_s") or 20.0)
    ref = engine_rate(t - w, t)
    s["top_vs_engine"].append(
        {
            "t": round(t, 1),
            "top_tok_s": r.get("tokens_per_s"),
            "engine_tok_s": None if ref is None else round(ref, 1),
            "ratio": round(r["tokens_per_s"] / ref, 3)
            if ref and r.get("tokens_per_s") is not None
            else None,
            "verdict": r.get("verdict"),
            "cause": r.get("cause"),
        }
    )

for f in ("findings.json", "server_info.json"):
    v = load(f)
    if v is not None:
        s[f.split(".")[0]] = (
            v
            if f != "server_info.json"
            else {
                k: v.get(k)
                for k in (
                    "max_running_requests",
                    "max_total_num_tokens",
                    "speculative_algorithm",
                    "mem_fraction_static",
                    "context_length",
                    "cuda_graph_max_bs",
                    "disable_cuda_graph",
                    "max_mamba_cache_size",
                    "chunked_prefill_size",
                )
            }
        )
try:
    s["cap"] = int((W / "cap.txt").read_text())
except (OSError, ValueError):
    pass
try:
    s["engine_command"] = (W / "engine_command.txt").read_text()
except OSError:
    pass
(W / "summary.json").write_text(json.dumps(s, indent=1))
for name, ph in phases.items():
    for part in ("whole", "steady"):
        v = ph.get(part) or {}
        print(
            f"{name:8s} {part:6s}",
            {
                k: v.get(k)
                for k in (
                    "s",
                    "decode_tok_s",
                    "engine_tok_s",
                    "mean_w",
                    "pct_limit",
                    "p90_w",
                    "util",
                    "sm_mhz",
                    "powercap_share",
                    "running_p50",
                    "queued_p50",
                    "accept_length",
                    "j_per_token",
                )
            },
        )
print(
    {
        k: s.get(k)
        for k in (
            "gpu",
            "engine_start_s",
            "direct",
            "genfleet",
            "genfleet_vs_direct_end_to_end",
            "genfleet_vs_direct_steady_engine",
            "top_vs_engine",
            "server_info",
        )
    }
)
print("findings:", json.dumps(s.get("findings"))[:3000])
