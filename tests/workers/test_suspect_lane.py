"""The suspect lane's rules, on one event loop: one suspect at a time after a death, twice as
many after each success, solo suspects alone and first, the latest sent before the death
first among equals."""

from __future__ import annotations

import asyncio

from genfleet.workers.feeding.suspects import SuspectLane


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_at_a_time_then_twice_as_many_after_each_success() -> None:
    async def scenario() -> list[int]:
        lane = SuspectLane()
        granted: list[int] = []

        async def suspect(n: int) -> None:
            await lane.enter((-1.0, -float(n)), solo=False)
            granted.append(n)

        tasks = [asyncio.create_task(suspect(n)) for n in range(7)]
        await settle()
        widths = [len(granted)]  # one alone
        for _ in range(3):
            for _ in range(lane.held):
                lane.leave(ok=True)
            await settle()
            widths.append(lane.held)
        await asyncio.gather(*tasks)
        return widths

    # 1 alone; its success opens 2; both succeed: 4 (only 4 left)
    assert asyncio.run(scenario())[:3] == [1, 2, 4]


def test_a_death_narrows_the_lane_to_one() -> None:
    async def scenario() -> tuple[int, int]:
        lane = SuspectLane()
        lane.width = 8
        for _ in range(3):
            await lane.enter((-1.0, 0.0), solo=False)  # width 8: three at once
        lane.died()
        for _ in range(3):
            lane.leave(ok=False)
        await lane.enter((-1.0, 0.0), solo=False)
        second = asyncio.create_task(lane.enter((-1.0, 0.0), solo=False))
        await settle()
        held = lane.held  # the first alone: width 1 after the death
        lane.leave(ok=False)
        await asyncio.wait_for(second, 1.0)
        return lane.width, held

    assert asyncio.run(scenario()) == (1, 1)


def test_solo_suspects_go_first_and_alone_then_the_latest_sent() -> None:
    async def scenario() -> list[str]:
        lane = SuspectLane()
        order: list[str] = []
        await lane.enter((-1.0, 0.0), solo=False)  # one in the engine already

        async def suspect(name: str, deaths: int, sent_at: float) -> None:
            await lane.enter((-float(deaths), -sent_at), solo=deaths >= 2)
            order.append(f"{name}:{'alone' if lane.solo else 'with others'}:{lane.held}")
            await asyncio.sleep(0)
            lane.leave(ok=True)

        tasks = [
            asyncio.create_task(suspect("early", 1, 10.0)),
            asyncio.create_task(suspect("late", 1, 20.0)),
            asyncio.create_task(suspect("twice", 2, 5.0)),
        ]
        await settle()
        assert order == []  # the lane is full
        lane.leave(ok=True)  # width 2 now, but the solo one goes first, alone
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["twice:alone:1", "late:with others:2", "early:with others:2"]


def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    async def scenario() -> bool:
        lane = SuspectLane()
        await lane.enter((-1.0, 0.0), solo=False)
        waiting = asyncio.create_task(lane.enter((-1.0, -5.0), solo=False))
        other = asyncio.create_task(lane.enter((-1.0, -1.0), solo=False))
        await settle()
        waiting.cancel()
        await settle()
        lane.leave(ok=False)
        await asyncio.wait_for(other, 1.0)
        return lane.held == 1

    assert asyncio.run(scenario())


def test_a_suspect_that_survives_its_arrival_widens_the_lane_and_frees_a_solo_turn() -> None:
    async def scenario() -> tuple[int, list[str]]:
        lane = SuspectLane()
        entered: list[str] = []
        await lane.enter((-2.0, 0.0), solo=True)  # a solo: alone
        assert lane.solo

        async def suspect(name: str, solo: bool) -> None:
            await lane.enter((-2.0 if solo else -1.0, 0.0), solo=solo)
            entered.append(name)

        tasks = [asyncio.create_task(suspect("other-solo", True))]
        tasks += [asyncio.create_task(suspect(f"plain{n}", False)) for n in range(3)]
        await settle()
        assert entered == []  # nobody while the solo is alone and unproven
        lane.survived(exclusive=True)  # the solo outlived its arrival
        await settle()
        assert entered == []  # the next solo needs the lane empty
        lane.leave(ok=True, exclusive=False)  # the first solo ends
        await settle()
        assert entered == ["other-solo"]
        lane.survived(exclusive=True)
        await settle()
        await asyncio.gather(*tasks)
        return lane.width, entered

    width, entered = asyncio.run(scenario())
    assert entered == ["other-solo", "plain0", "plain1", "plain2"] and width >= 4


def test_calm_is_clear_exactly_while_a_solo_holds_the_lane() -> None:
    """Fresh prompts wait for `calm`: clear from a solo's grant until it survives or leaves,
    whichever first, and untouched by suspects that are not solos."""

    async def scenario() -> list[bool]:
        lane = SuspectLane()
        seen = [lane.calm.is_set()]
        await lane.enter((-1.0, 0.0), solo=False)
        seen.append(lane.calm.is_set())
        lane.leave(ok=True, exclusive=False)
        await lane.enter((-2.0, 0.0), solo=True)
        seen.append(lane.calm.is_set())
        lane.survived(exclusive=True)  # its answer began
        seen.append(lane.calm.is_set())
        lane.leave(ok=True, exclusive=False)
        await lane.enter((-2.0, 0.0), solo=True)
        seen.append(lane.calm.is_set())
        lane.leave(ok=False, exclusive=True)  # failed before its answer began
        seen.append(lane.calm.is_set())
        return seen

    assert asyncio.run(scenario()) == [True, True, False, True, False, True]
