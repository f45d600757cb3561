"""`genfleet flower`: Flower on genfleet's Celery app and settings, set up for this fleet.

Flower runs with this very file as its `--conf`: Flower executes it and reads the names
below that are its options (`tasks_columns`, `format_task`, `state_save_interval`), so the
Tasks page shows each task's result as the line a person reads (`workers/observe/headlines`).
No other top-level name here may be a Flower or Tornado option (`port`, `address`, `db`,
`logging`, ...).

Basic auth comes from Flower's own `FLOWER_BASIC_AUTH=user:password` (never argv); without
it Flower only listens on loopback. State (tasks, workers) is kept across restarts in `--db`:
a pickle, which Flower loads and so runs, in a process that holds the Redis password and the
store's keys. It lives in this user's private state directory unless `--db` names another
place, and a place others can write to is refused.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from genfleet.common.flags import fail
from genfleet.common.private import private_dir
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


def state_home() -> Path:
    """Where a user's state lives across reboots: $XDG_STATE_HOME, else ~/.local/state."""
    named = os.environ.get("XDG_STATE_HOME")
    return Path(named) if named else Path.home() / ".local" / "state"


def flower_db(db: str | None) -> str:
    """Flower's state file: `db`, or `flower.db` in this user's private state directory.

    Flower unpickles it at start, so a file someone else could write is code they run as
    Flower: a `db` in a directory other users may write to (without the sticky bit's
    protection of their own files, or with it: /tmp lets anyone plant the name first), or a
    file that is not this user's or is writable by others, is refused with the reason."""
    if db is None:
        home = state_home()
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        return str(private_dir("flower", root=home) / "flower.db")
    path = Path(db).absolute()
    where = os.stat(path.parent)
    if stat.S_IMODE(where.st_mode) & 0o022 or where.st_uid not in (os.getuid(), 0):
        fail(
            f"--db {db}: its directory {path.parent} can be written by other users, who could "
            "plant the state Flower loads (a pickle: code run as Flower): choose a directory "
            "of your own, or leave --db out"
        )
    for name in path.parent.glob(path.name + "*"):  # shelve adds suffixes (.db, .dat, .dir)
        info = os.lstat(name)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
            fail(
                f"--db {db}: {name} is not yours alone (owner uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}): Flower would load it; remove it"
            )
    return str(path)


def launch(settings: Settings, port: int, address: str, db: str | None) -> None:
    """Check auth and the state file, hand the settings to the Celery app, run Flower in this
    process."""
    if not os.environ.get("FLOWER_BASIC_AUTH") and not loopback(address):
        fail(f"Flower on {address} needs FLOWER_BASIC_AUTH=user:password in the environment")
    db = flower_db(db)
    from genfleet.workers.app import app, configure

    configure(settings)
    app.start(flower_argv(port, address, db))
