"""What genfleet keeps to this user on this host: a private directory, files in it opened
without following symlinks, and child processes that do not outlive their parent.

The directory is `$TMPDIR/genfleet-UID/NAME`, each level 0700 and checked to be a real
directory owned by this user, not a link someone planted in /tmp: port locks, an engine's
`--config` file (its API key), engine logs, beat's schedule (a pickle) and the lock of
`genfleet run`'s local fleet live there.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path

from genfleet.common.errors import ConfigError


class NotPrivate(ConfigError):
    """A level of the private directory is a link, not a directory, someone else's, or open
    to other users."""


def private_dir(name: str, root: Path | None = None) -> Path:
    """`root/genfleet-UID/name` (root: the temp directory), each level 0700 and this user's.

    Raises NotPrivate when a level is a symlink, not a directory, someone else's, or open to
    others: a predictable path in /tmp is otherwise an invitation.
    """
    base = (root or Path(tempfile.gettempdir())) / f"genfleet-{os.getuid()}"
    for path in (base, base / name):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise NotPrivate(f"{path} is not a directory of this user's own: remove it")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise NotPrivate(
                f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): chmod 700 it"
            )
    return base / name


def open_private(path: Path, flags: int = os.O_RDWR) -> int:
    """Open (creating, 0600) a file without following a symlink at its name."""
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def die_with_parent() -> None:
    """In a child (`preexec_fn`): get SIGTERM when the parent dies, even by SIGKILL (Linux
    only; elsewhere a no-op)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
