"""`python -m genfleet.workers.engine.emulator --model-path M --port P [any SGLang flag]`.

Started by the supervisor exactly like `sglang serve`; its knobs come from the environment
(`GENFLEET_EMULATOR_*`, read through genfleet.common.settings.Settings once, here at the edge).

SIGUSR1 makes it hang the way a GPU that never finishes a kernel hangs an engine: no token, no
answer (health included), one core busy (the CUDA runtime polls the GPU). `kill -STOP` is the
other kind of freeze: no CPU time at all. The stall watchdog finds them by different evidence.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from genfleet.common.settings import Settings
from genfleet.workers.engine.emulator.args import LaunchError, parse_args
from genfleet.workers.engine.emulator.server import serve
from genfleet.workers.engine.emulator.sim.stepper import Knobs

LOG_FORMAT = "[%(asctime)s%(tp)s] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _TpDefault(logging.Filter):
    """Scheduler lines carry " TP0" after the time, as in SGLang's logs; others nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "tp"):
            record.tp = ""
        return True


def configure_logging(level: str) -> None:
    """SGLang's format on stderr: `[YYYY-MM-DD HH:MM:SS] msg`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.addFilter(_TpDefault())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("aiohttp").setLevel(logging.WARNING)


async def _run(argv: list[str]) -> int:
    args = parse_args(argv)
    knobs = Knobs.from_settings(Settings())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _hang)
    return await serve(args, knobs, stop)


def _hang() -> None:
    """A hang that spins (module docstring): the event loop never gets back its thread."""
    logging.getLogger("genfleet.workers.engine.emulator").warning("SIGUSR1: hanging, spinning")
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging(_log_level(argv))
    try:
        return asyncio.run(_run(argv))
    except LaunchError as exc:
        logging.getLogger("genfleet.workers.engine.emulator").error("%s", exc)
        return 1


def _log_level(argv: list[str]) -> str:
    """--log-level before full parsing, so parse-time warnings already honour it."""
    for i, arg in enumerate(argv):
        if arg.startswith("--log-level="):
            return arg.split("=", 1)[1]
        if arg == "--log-level" and i + 1 < len(argv):
            return argv[i + 1]
    return "info"


if __name__ == "__main__":
    sys.exit(main())
