"""A dry-run stand-in for SGLang: same argv, same HTTP API, a simulated GPU.

Launched like SGLang (`python -m genfleet.workers.engine.emulator --model-path M --port P …`) by the
same supervisor, so CI, the dry-run compose profile and the benchmarks exercise the real
supervision path. Modules: `args` (SGLang's flags and defaults), `sim.model` (the pure
continuous-batching time model), `sim.power` (simulated power draw and energy), `sim.text`
(token counting and filler text), `sim.stepper` (the stepping loop), `sim.tokenizer` (a
reversible synthetic tokenizer), `sim.chat_template` (the checkpoint's chat template, rendered
as transformers does), `sim.generation_prompt` (where a prompt's ids end and drawn output
begins), `sim.answer` (a /generate answer token by token), `routes.chat`/`routes.generate`
(the two generation APIs), `routes.tokenize` (/v1/tokenize, /v1/detokenize), `routes.metrics`
(/metrics), `server` (routes and the start-up sequence).
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
