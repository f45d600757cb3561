"""Faults only two hosts can have, on a fleet of two nodes (harness/multinode.py): node 2 is a
network namespace whose workers reach Redis and S3 over a veth link.

- cut off for longer than its lease, then healed: its batches are redone on node 1 and its
  late answers refused by the write-once put;
- lost whole (link cut, every process SIGKILLed, veth down): Redis never hears it go, the
  leases find its batches and node 1 finishes them;
- its clock ten minutes ahead, or behind, or the reaper's behind: a run is done exactly once,
  and a cut is recovered from as fast as with true clocks (claims were stamped by the
  worker's clock and judged by the reaper's, which hid a silent worker's batches for as long
  as its clock ran ahead of the reaper's).

Every scenario ends with every prompt exactly once in the store, nothing parked, and node 2's
batches re-sent within the bound the lease and the reaper set (`play` checks all three). Two
of them run here (the cut, a clock ahead); `bench/multinode.py` plays all five (also the node
lost whole, its clock behind, the reaper's clock behind), its figures in bench/RESULTS.md.
Needs root, `ip` and `nft`; the clock test needs libfaketime (the dev extra's package).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.multinode import log_clock_offset_s, play, two_nodes
from harness.nodes import libfaketime, unavailable

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.fault,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
    pytest.mark.timeout(240),
]
PROMPTS = 300  # 12 batches: node 2 holds a few when the fault comes, node 1 has its own


def test_a_node_cut_off_past_its_lease_is_redone_elsewhere_and_its_late_answers_refused(
    tmp_path: Path,
) -> None:
    with two_nodes(tmp_path) as fleet:
        figures = play(fleet, "cut", "cut", PROMPTS)
    print(f"\n{figures.line()}")
    assert (figures.duplicates, figures.lost) == (0, 0)
    assert figures.held, "node 2 held no batch when its link was cut"
    assert figures.redone >= len(figures.held)
    # Its copies came back after node 1 wrote the outputs: each found its output written.
    assert figures.refused >= 1
    # Redis never saw node 2 go (nothing reached it): the leases, not the connections, told.
    assert figures.node2_connections > 0
    assert figures.node2_back_s is not None  # its worker survived the cut and answers again


@pytest.mark.skipif(libfaketime() is None, reason="libfaketime is not installed (dev extra)")
def test_a_node_whose_clock_is_ahead_is_judged_by_redis_clock(tmp_path: Path) -> None:
    offset_s = 600
    with two_nodes(tmp_path, clock_offset_s=offset_s) as fleet:
        (node2,) = fleet.workers[2]
        assert abs(log_clock_offset_s(node2) - offset_s) < 60, "node 2's clock is not off"
        plain = play(fleet, "none", "plain", PROMPTS)
        cut = play(fleet, "cut", "cut", PROMPTS)
    print(f"\n{plain.line()}\n{cut.line()}")
    assert plain.node2_wrote > 0  # node 2 did its share of the plain run
    for figures in (plain, cut):
        assert (figures.duplicates, figures.lost) == (0, 0)
    assert cut.held and cut.refused >= 1
