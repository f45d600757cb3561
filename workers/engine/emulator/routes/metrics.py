"""GET /metrics: SGLang's `sglang:` names in Prometheus text format 0.0.4 (contract §3).

Rendered by hand from the scheduler's tallies rather than through prometheus_client, so the
request path only bumps integers. Scheduler gauges carry `engine_type, model_name,
moe_ep_rank, pp_rank, tp_rank`; tokenizer counters carry `engine_type, model_name`, exactly as
SGLang labels them. Histograms and the HTTP counters are not emulated.
"""

from __future__ import annotations

from genfleet.workers.engine.emulator.sim.stepper import Engine


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def render(engine: Engine, startup_s: float, load_s: float) -> str:
    """The whole exposition, one scrape's worth."""
    args = engine.args
    s = engine.scheduler
    t = s.tallies
    model = args.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
    base = {"engine_type": "unified", "model_name": model}
    sched = _labels(base | {"moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"})
    tok = _labels(base)
    used = sum(seq.prompt_tokens + seq.generated for seq in s.running)
    spec = args.spec
    gauges: list[tuple[str, str, float]] = [
        ("num_running_reqs", "The number of running requests.", len(s.running)),
        ("num_queue_reqs", "The number of requests in the waiting queue.", len(s.waiting)),
        ("num_grammar_queue_reqs", "The number of requests in the grammar queue.", 0),
        ("gen_throughput", "The generation throughput (token/s).", t.last_gen_throughput),
        ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
        ("token_usage", "The token usage.", used / args.max_total_num_tokens),
        ("num_used_tokens", "The number of used tokens.", used),
        ("spec_accept_length", "The average acceptance length.", t.last_spec_accept_length),
        ("spec_accept_rate", "The average acceptance rate.", _accept_rate(engine)),
        ("spec_num_steps", "Speculative steps.", spec.num_steps if spec else 0),
        ("spec_num_draft_tokens", "Draft tokens.", spec.num_draft_tokens if spec else 0),
        ("utilization", "The utilization.", min(1.0, len(s.running) / args.max_running_requests)),
        ("is_cuda_graph", "Whether the batch is using CUDA graph.", 1.0 if s.running else 0.0),
        ("max_total_num_tokens", "Maximum total number of tokens.", args.max_total_num_tokens),
        ("context_len", "The context length.", args.context_length),
        ("engine_startup_time", "The time taken for the engine to start up.", startup_s),
        ("engine_load_weights_time", "The time taken to load weights.", load_s),
    ]
    counters: list[tuple[str, str, float]] = [
        ("prompt_tokens_total", "Number of prefill tokens processed.", t.prompt_tokens),
        ("generation_tokens_total", "Number of generation tokens processed.", t.generation_tokens),
        ("num_requests_total", "Number of requests processed.", t.requests),
        ("num_aborted_requests_total", "Number of requests aborted.", t.aborted),
        ("spec_verify_calls_total", "Number of speculative verify calls.", t.spec_forward_ct),
    ]
    lines: list[str] = []
    for name, help_text, value in gauges:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge"]
        lines.append(f"sglang:{name}{sched} {float(value)!r}")
    for name, help_text, value in counters:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
        lines.append(f"sglang:{name}{tok} {float(value)!r}")
    return "\n".join(lines) + "\n"


def _accept_rate(engine: Engine) -> float:
    spec = engine.args.spec
    t = engine.scheduler.tallies
    if spec is None or spec.num_draft_tokens <= 1 or not t.last_spec_accept_length:
        return 0.0
    return (t.last_spec_accept_length - 1) / (spec.num_draft_tokens - 1)
