"""`genfleet flower`: Flower on genfleet's Celery app and settings, set up for this fleet.

Flower runs with this very file as its `--conf`: Flower executes it and reads the names
below that are its options (`tasks_columns`, `format_task`, `state_save_interval`), so the
Tasks page shows each task's result as the line a person reads (`workers/observe/headlines`).
No other top-level name here may be a Flower or Tornado option (`port`, `address`, `db`,
`logging`, ...).

Basic auth comes from Flower's own `FLOWER_BASIC_AUTH=user:password` (never argv); without
it Flower only listens on loopback. State (tasks, workers) is kept across restarts in `--db`.
"""

from __future__ import annotations

import ipaddress
import os

from genfleet.common.flags import fail
from genfleet.common.settings import Settings
from genfleet.workers.observe.headlines import flower_format_task

# Flower's options, read when Flower executes this file.
tasks_columns = "name,state,result,received,runtime,worker"
format_task = flower_format_task
state_save_interval = 60_000  # ms: a killed Flower loses at most a minute of task history


def loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def flower_argv(port: int, address: str, db: str) -> list[str]:
    """The `celery flower` arguments `genfleet flower` runs with (compose runs the same)."""
    return [
        "flower",
        f"--conf={os.path.abspath(__file__)}",
        f"--port={port}",
        f"--address={address}",
        "--persistent=True",
        f"--db={db}",
    ]


def launch(settings: Settings, port: int, address: str, db: str) -> None:
    """Check auth, hand the settings to the Celery app, run Flower in this process."""
    if not os.environ.get("FLOWER_BASIC_AUTH") and not loopback(address):
        fail(f"Flower on {address} needs FLOWER_BASIC_AUTH=user:password in the environment")
    from genfleet.workers.app import app, configure

    configure(settings)
    app.start(flower_argv(port, address, db))
