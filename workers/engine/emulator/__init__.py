"""A dry-run stand-in for SGLang: same argv, same HTTP API, a simulated GPU.

Launched like SGLang (`python -m genfleet.workers.engine.emulator --model-path M --port P …`) by the
same supervisor, so CI, the dry-run compose profile and the benchmarks exercise the real
supervision path. Modules: `args` (SGLang's flags and defaults), `model` (the pure
continuous-batching time model), `power` (simulated power draw and energy), `text` (token
counting and filler text), `engine` (the stepping loop), `chat`/`generate` (the two
generation APIs), `metrics` (/metrics), `server` (routes and the start-up sequence).
"""

from genfleet.workers.engine.emulator.args import EngineArgs, LaunchError, SpecConfig, parse_args
from genfleet.workers.engine.emulator.sim.model import (
    Scheduler,
    Sequence,
    TimeModel,
    natural_length,
    plan_length,
)
from genfleet.workers.engine.emulator.sim.power import EnergyMeter, PowerModel
from genfleet.workers.engine.emulator.sim.stepper import Knobs

__all__ = [
    "EnergyMeter",
    "EngineArgs",
    "Knobs",
    "LaunchError",
    "PowerModel",
    "Scheduler",
    "Sequence",
    "SpecConfig",
    "TimeModel",
    "natural_length",
    "parse_args",
    "plan_length",
]
