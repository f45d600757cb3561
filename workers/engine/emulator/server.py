"""The HTTP face and the start-up sequence, in SGLang's order (contract §5, §9).

1. "Loading": the port stays closed for `emulator_load_s` (real seconds, never time-scaled).
2. Bind: /v1/models and /model_info answer at once; /health answers 503 with an empty body.
3. Warm-up for `emulator_warmup_s` (skipped with --skip-server-warmup); then /health takes
   `min(1 s, 1 s / time_scale)` and answers 200, and the readiness line is logged at INFO.
SIGTERM or SIGINT stops it at any stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from aiohttp import web

from genfleet.workers.engine.emulator.args import EngineArgs, server_args_dict
from genfleet.workers.engine.emulator.routes import chat, generate, metrics, tokenize
from genfleet.workers.engine.emulator.routes.error_bodies import json_response
from genfleet.workers.engine.emulator.sim.power import NodeKnobs, gpu_readings
from genfleet.workers.engine.emulator.sim.stepper import TP0, Engine, Knobs

log = logging.getLogger("genfleet.workers.engine.emulator")
VERSION = "0.5.23+emulator"
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/genfleet/power"})
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


class State:
    """What the routes share: the engine, readiness and start-up timings."""

    def __init__(self, engine: Engine, started_wall: float):
        self.engine = engine
        self.ready = False
        self.created = int(started_wall)
        self.started_wall = started_wall
        self.load_s = 0.0
        self.startup_s = 0.0


def _state(request: web.Request) -> State:
    state: State = request.app["state"]
    return state


async def health(request: web.Request) -> web.Response:
    """503 until warm-up ends, then 200 after a simulated 1-token generation; empty bodies."""
    state = _state(request)
    if not state.ready:
        return web.Response(status=503)
    await asyncio.sleep(state.engine.knobs.health_delay_s)
    return web.Response(status=200)


def _model_card(args: EngineArgs, created: int) -> dict[str, Any]:
    name = args.served_model_name
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": args.context_length,
    }


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    return json_response(
        {"object": "list", "data": [_model_card(state.engine.args, state.created)]}
    )


async def model_by_name(request: web.Request) -> web.Response:
    state = _state(request)
    name = request.match_info["model"]
    if name == state.engine.args.served_model_name:
        return json_response(_model_card(state.engine.args, state.created))
    error = {
        "message": f"The model '{name}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return json_response({"error": error}, 404)


async def model_info(request: web.Request) -> web.Response:
    if request.path.startswith("/get_"):
        log.warning("The /get_model_info API is deprecated; use /model_info instead.")
    args = _state(request).engine.args
    return json_response(
        {
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": args.model_type,
            "architectures": args.architectures,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """Flat server args + scheduler handshake + one internal state per DP rank."""
    if request.path.startswith("/get_"):
        log.warning("The /get_server_info API is deprecated; use /server_info instead.")
    engine = _state(request).engine
    args = engine.args
    flat = server_args_dict(args)
    t = engine.scheduler.tallies
    internal: dict[str, Any] = {
        **flat,
        "last_gen_throughput": t.last_gen_throughput,
        "memory_usage": {
            "weight": 35.0,
            "kvcache": 80.0,
            "token_capacity": args.max_total_num_tokens,
            "graph": 1.5,
        },
        "effective_max_running_requests_per_dp": engine.enforced_max_running // args.dp_size,
    }
    if args.spec is not None and t.avg_spec_accept_length is not None:
        internal["avg_spec_accept_length"] = t.avg_spec_accept_length
    return json_response(
        {
            **flat,
            "status": "ready",
            "max_total_num_tokens": args.max_total_num_tokens,
            "max_req_input_len": args.max_req_input_len,
            "internal_states": [internal] * args.dp_size,
            "version": VERSION,
            "kv_events": None,
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    busy = _state(request).engine.scheduler.busy
    return web.Response(text=FLUSH_TEXT, status=400 if busy else 200)


PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def prometheus(request: web.Request) -> web.Response:
    state = _state(request)
    body = metrics.render(state.engine, state.startup_s, state.load_s)
    # prometheus_client's exposition type, as SGLang serves it.
    return web.Response(body=body.encode(), headers={"Content-Type": PROMETHEUS_TYPE})


async def power(request: web.Request) -> web.Response:
    """GET /genfleet/power: the simulated GPUs, `{"gpus": [...]}` (not an SGLang route)."""
    engine = _state(request).engine
    s = engine.scheduler
    body = gpu_readings(
        port=engine.args.port,
        tp_size=engine.args.tp_size,
        model=engine.power,
        meter=engine.meter,
        running=len(s.running),
        queued=len(s.waiting),
        max_running=engine.args.max_running_requests,
        mem_fraction_static=engine.args.mem_fraction_static,
        now=engine.clock(),
        node=NodeKnobs(os.getpid(), engine.knobs.unclaimed_gpus, engine.knobs.foreign_process_mib),
    )
    return json_response(body)


def _auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}"

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in OPEN_PATHS or request.headers.get("Authorization") == expected:
            response: web.StreamResponse = await handler(request)
            return response
        return json_response({"error": "Unauthorized"}, 401)

    return auth


def build_app(state: State) -> web.Application:
    args = state.engine.args
    middlewares = [_auth_middleware(args.api_key)] if args.api_key else []
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    app["state"] = state
    app["engine"] = state.engine
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_by_name)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_post("/generate", generate.generate)
    for path in ("/v1/tokenize", "/tokenize"):
        app.router.add_post(path, tokenize.tokenize)
    for path in ("/v1/detokenize", "/detokenize"):
        app.router.add_post(path, tokenize.detokenize)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/genfleet/power", power)
    if args.enable_metrics:
        app.router.add_get("/metrics", prometheus)
    return app


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` unless `stop` fires first; True when stopped."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


async def serve(args: EngineArgs, knobs: Knobs, stop: asyncio.Event) -> int:
    """Run the whole lifecycle until `stop` is set; the process exit code."""
    started = time.monotonic()
    log.info("Load weight begin. avail mem=139.81 GB", extra=TP0)
    if await _wait(stop, knobs.load_s):
        return 0
    log.info("Load weight end. type=%s, avail mem=104.10 GB", args.architectures[0], extra=TP0)
    log.info(
        "KV Cache is allocated. #tokens: %d, K size: 20.00 GB, V size: 20.00 GB",
        args.max_total_num_tokens,
        extra=TP0,
    )
    engine = Engine(args, knobs)
    state = State(engine, time.time())
    state.load_s = time.monotonic() - started
    runner = web.AppRunner(build_app(state), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        log.error("Failed to bind %s:%d: %s", args.host, args.port, exc)
        await runner.cleanup()
        return 1
    engine.start()
    log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", args.host, args.port)
    try:
        if args.skip_server_warmup or not await _wait(stop, knobs.warmup_s):
            state.startup_s = time.monotonic() - started
            state.ready = True
            log.info("The server is fired up and ready to roll!")
            await stop.wait()
    finally:
        await engine.stop()
        await runner.cleanup()
    return 0
