"""A second node on this machine: a Linux network namespace joined to the root namespace by a
veth pair, whose processes reach the root namespace's Redis and S3 only over that link.

    root namespace (node 1)                       namespace gfn-XXXXXX (node 2)
    Redis, S3, control + node-1 workers           node-2 workers, each with its engine
    10.77.N.1 ── gfr-XXXXXX ═══ veth ═══ gfn-XXXXXX ── 10.77.N.2      (own 127.0.0.1)

The link can be cut (`cut`: nftables inside the namespace drops everything on the veth, as a
switch that fails silently would: no reset, no error, only timeouts) and healed, or pulled
(`unplug`: the root side of the veth down). `kill_all` SIGKILLs every process inside, which
with the link cut first is a host that lost its power: Redis holds its connections open,
since no FIN ever reaches it. Each node has a name and a /30 of its own, so runs side by side
do not clash; `close` deletes the namespace, which takes the veth and the nftables rules
with it.

`clock_env` puts a node's processes `offset_s` off the real clock through libfaketime
(LD_PRELOAD): wall time only, monotonic time stays true. The library is the one the PyPI
package `libfaketime` ships (the dev extra), not Debian's 0.9.10 (bookworm's `faketime`):
under that one a CPython 3.11 process either fails every `time.sleep` with EINVAL
(FAKETIME_DONT_FAKE_MONOTONIC=1: its clock_nanosleep shifts an absolute monotonic deadline
by the offset) or, with monotonic time faked too, waits the whole offset in every timed
`Event.wait`, so a worker cannot even start.

Needs root, `ip` (iproute2) and `nft` (nftables); `unavailable()` says what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

BLOCK = "10.77"  # each node's link is 10.77.N.0/30, N the lowest not in use here
BLOCK_LOCK = "/run/genfleet-nodes.lock"  # held while a node picks its block
CUT_TABLE = "genfleet_cut"


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why no second node can be made here (a test's skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "a second node needs root (network namespaces, veth pairs, nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"no `{tool}` here: apt-get install {package}"
    probe = f"gfprobe-{uuid.uuid4().hex[:6]}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def libfaketime() -> str | None:
    """The path of the libfaketime.so.1 the PyPI package `libfaketime` ships, or None."""
    spec = importlib.util.find_spec("libfaketime")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        library = Path(folder) / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
        if library.is_file():
            return str(library)
    return None


def clock_env(offset_s: int) -> dict[str, str]:
    """The environment that puts a process (and its children) `offset_s` seconds off the real
    wall clock: libfaketime preloaded, monotonic clocks left true (a fake monotonic clock would
    shift every timeout inside the process, which no real host with a wrong clock sees)."""
    library = libfaketime()
    if library is None:
        raise RuntimeError("libfaketime is not installed: pip install libfaketime")
    return {
        "LD_PRELOAD": library,
        "FAKETIME": f"{offset_s:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def _free_block() -> int:
    """The lowest N such that no address of 10.77.N.0/24 is in use in the root namespace."""
    used = set()
    for word in _ip("-o", "-4", "addr", "show").split():
        if word.startswith(f"{BLOCK}."):
            used.add(int(word.split(".")[2]))
    return next(n for n in range(256) if n not in used)


class Node:
    """A second node: a namespace, its veth link and its addresses. `create()` first."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"gfn-{tag}"
        self.root_if = f"gfr-{tag}"  # interface names: 15 characters at most
        self.node_if = f"gfn-{tag}"
        self.block = -1
        self.created = False
        self.is_cut = False

    @property
    def root_ip(self) -> str:
        """The root namespace's address on the link: where node 2 finds Redis and S3."""
        return f"{BLOCK}.{self.block}.1"

    @property
    def node_ip(self) -> str:
        return f"{BLOCK}.{self.block}.2"

    def create(self) -> Node:
        _ip("netns", "add", self.name)
        self.created = True
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.node_if,
            "netns", self.name)  # fmt: skip
        # One block each: two nodes made at once (parallel tests) must not pick the same.
        with open(BLOCK_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.block = _free_block()
            _ip("addr", "add", f"{self.root_ip}/30", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")
        _ip("addr", "add", f"{self.node_ip}/30", "dev", self.node_if, namespace=self.name)
        _ip("link", "set", self.node_if, "up", namespace=self.name)
        _ip("link", "set", "lo", "up", namespace=self.name)  # each engine's 127.0.0.1
        return self

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside the node (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        """Drop every packet on the link, both ways, silently (nothing is reset)."""
        rules = (
            f"table inet {CUT_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority -10; "
            f'iifname "{self.node_if}" drop; }}\n'
            f"  chain output {{ type filter hook output priority -10; "
            f'oifname "{self.node_if}" drop; }}\n'
            "}\n"
        )
        subprocess.run(
            self.wrap(["nft", "-f", "-"]), input=rules, text=True, check=True, capture_output=True
        )
        self.is_cut = True

    def heal(self) -> None:
        """Let packets flow again (connections that outlived the cut carry on)."""
        subprocess.run(
            self.wrap(["nft", "delete", "table", "inet", CUT_TABLE]),
            check=True,
            capture_output=True,
        )
        self.is_cut = False

    def unplug(self) -> None:
        """Take the root side of the veth down: the link is gone for good."""
        _ip("link", "set", self.root_if, "down", check=False)

    def pids(self) -> list[int]:
        """Every process inside the node now."""
        if not self.created:
            return []
        out = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, timeout_s: float = 10.0) -> list[int]:
        """SIGKILL every process inside at once; returns their pids once all are gone."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def close(self) -> None:
        """Kill what runs inside and delete the namespace (its veth and rules go with it)."""
        if not self.created:
            return
        self.kill_all()
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.root_if, check=False)  # gone with the namespace, normally
        self.created = False


@contextlib.contextmanager
def second_node() -> Iterator[Node]:
    """A second node for the block's length, deleted after it whatever happened."""
    node = Node()
    try:
        yield node.create()
    finally:
        node.close()
