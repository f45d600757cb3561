"""1 Hz GPU and engine sampler: `sample.py nvml OUT.jsonl` (NVML power, energy counter, limit,
util, SM clock, memory, throttle reasons) or `sample.py metrics URL OUT.jsonl` (SGLang's
/metrics gauges and counters, histogram buckets dropped, every second). Runs until killed."""

import json
import sys
import time
import urllib.request


def nvml(path):
    import pynvml as n

    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "name": n.nvmlDeviceGetName(h),
                    "limit_w": n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                    "default_limit_w": n.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000,
                }
            )
            + "\n"
        )
        while True:
            t = time.time()
            try:
                u = n.nvmlDeviceGetUtilizationRates(h)
                row = {
                    "t": round(t, 3),
                    "w": n.nvmlDeviceGetPowerUsage(h) / 1000,
                    "e_mj": n.nvmlDeviceGetTotalEnergyConsumption(h),
                    "lim": n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                    "util": u.gpu,
                    "mutil": u.memory,
                    "sm": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                    "mem_mib": n.nvmlDeviceGetMemoryInfo(h).used // 2**20,
                    "temp": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    "thr": n.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                }
            except Exception as exc:  # keep sampling
                row = {"t": round(t, 3), "err": repr(exc)}
            f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(max(0.0, 1.0 - (time.time() - t)))


def metrics(url, path):
    keep = (
        "sglang:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:spec_accept_length",
        "sglang:token_usage",
        "sglang:num_requests_total",
        "sglang:mamba_usage",
        "sglang:max_running_requests",
        "sglang:spec_accept_rate",
    )
    with open(path, "a") as f:
        while True:
            t = time.time()
            try:
                text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
                vals = {}
                for line in text.splitlines():
                    if line.startswith(keep):
                        name, _, value = line.rpartition(" ")
                        vals[name.split("{")[0]] = vals.get(name.split("{")[0], 0.0) + float(value)
                f.write(json.dumps({"t": round(t, 3), **vals}) + "\n")
                f.flush()
            except Exception as exc:
                f.write(json.dumps({"t": round(t, 3), "err": repr(exc)[:200]}) + "\n")
            time.sleep(max(0.0, 1.0 - (time.time() - t)))


if __name__ == "__main__":
    if sys.argv[1] == "nvml":
        nvml(sys.argv[2])
    else:
        metrics(sys.argv[2], sys.argv[3])
