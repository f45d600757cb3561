"""`python -m genfleet.workers worker|control|preflight|top|tune …`: the GPU side alone.

The same commands, with the same flags, as `genfleet worker …` (see `genfleet.workers.cli`);
worker processes started by `genfleet worker --gpus …` and `genfleet run` run this way.
"""

from __future__ import annotations

from genfleet.common.errors import GenfleetError
from genfleet.common.flags import fail
from genfleet.workers.cli import app


def main() -> None:
    """Expected failures exit 2 with one line, never a traceback."""
    try:
        app(prog_name="python -m genfleet.workers")
    except GenfleetError as exc:
        fail(str(exc))


if __name__ == "__main__":
    main()
