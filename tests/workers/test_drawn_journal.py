"""The journal of answers in flight (workers/drawn_journal.py): what a try drew since its last
checkpoint, kept in Redis, and the answers the next try rebuilds from copies and lines.

The rule under test: an answer is rebuilt from one draw only, a copy and one try's lines
after it, never ids of two tries; a line goes on from exactly the ids so far or not at all."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from genfleet.common import keys
from genfleet.workers import drawn_journal
from genfleet.workers.drawn_journal import FROM_START, Journal, Resumed, resumed
from genfleet.workers.feeding import Drawn, Mark
from genfleet.workers.feeding.native import GenerateStream
from tests.fakes.memory_redis import MemoryRedis

BOUND = "ab12:" + "d" * 64  # the order's staging and its batch's input digest
A, B = ("p0", 0), ("p1", 0)
NAMES = {A, B}


def drawn(ids: list[int], text: str = "", in_reasoning: bool = False) -> Drawn:
    answer = Drawn(in_reasoning=in_reasoning)
    answer.add(ids, text)
    return answer


def delta(answer: Drawn, start: Drawn, base: int, name: tuple[str, int] = A) -> dict[str, Any]:
    """A line's entry: what `answer` drew after the state `start` holds."""
    piece = answer.since(start.mark())
    assert piece is not None
    piece["from"] = len(start.ids)
    return {"id": name[0], "sample": name[1], "base": base, **piece}


def line(*answers: dict[str, Any], bound: str = BOUND) -> dict[str, Any]:
    return {"for": bound, "answers": list(answers)}


# --- an answer's delta ------------------------------------------------------------------------


def test_what_an_answer_drew_after_a_mark_rebuilds_it_whole_from_a_copy_at_that_mark() -> None:
    answer = Drawn(in_reasoning=True)
    answer.add([1, 2], "<think>Let me")
    answer.add([3], " see")
    copy = Drawn.from_json(answer.to_json())
    mark = answer.mark()
    answer.add([4, 5], " more.</think>")
    answer.add([6], "The answer")
    since = answer.since(mark)
    assert since is not None and since["from"] == 3 and since["ids"] == [4, 5, 6]
    assert copy.extend(since)
    assert copy.to_json() == answer.to_json()
    assert answer.since(answer.mark()) is None  # nothing drawn since


def test_a_delta_of_another_point_never_joins_an_answer() -> None:
    answer = drawn([1, 2, 3], "abc")
    mark = answer.mark()
    answer.add([4], "d")
    since = answer.since(mark)
    assert since is not None
    shorter = drawn([1, 2], "ab")
    assert not shorter.extend(since)
    assert list(shorter.ids) == [1, 2]
    # A delta with its state (the first after an unknown one) names how its answer opened.
    with_state = answer.since(Mark(3, 1, 0, 0))
    assert with_state is not None and "opened_in_reasoning" in with_state
    opened_otherwise = drawn([1, 2, 3], "abc", in_reasoning=True)
    assert not opened_otherwise.extend(with_state)
    assert drawn([1, 2, 3], "abc").extend(with_state)


def test_a_delta_carries_the_splits_state_only_when_it_changed() -> None:
    """A line a second for every answer in flight: what did not change is left out, and the
    answer rebuilt from the copy and such deltas is the answer."""
    answer = Drawn(in_reasoning=True)
    answer.add([1], "<think>a")
    copy = Drawn.from_json(answer.to_json())
    first = answer.mark()
    answer.add([2], "b")
    plain = answer.since(first)
    assert plain is not None and "in_reasoning" not in plain and "content" not in plain
    second = answer.mark()
    answer.add([3], "</think>The")  # the split moves to content: its state goes along
    moved = answer.since(second)
    assert moved is not None and moved["in_reasoning"] is False and moved["content"] == "The"
    assert copy.extend(plain) and copy.extend(moved)
    assert copy.to_json() == answer.to_json()


def test_an_answer_whose_text_was_decoded_again_gives_no_delta_from_an_older_mark() -> None:
    answer = drawn([1, 2], "ab")
    mark = answer.mark()
    answer.add([3], "c")
    answer.retext("abc")
    assert answer.since(mark) is None


# --- what the next try rebuilds ----------------------------------------------------------------


def test_a_copy_alone_is_gone_on_from_with_its_base() -> None:
    copy = drawn([1, 2, 3], "abc")
    got = resumed({A: {4: copy.to_json()}}, {}, BOUND, NAMES)
    assert list(got[A].drawn.ids) == [1, 2, 3]
    assert got[A].base == (4, copy.mark())


def test_a_copy_and_its_tries_lines_make_the_longest_answer_with_no_base() -> None:
    copy = drawn([1, 2, 3], "abc")
    live = Drawn.from_json(copy.to_json())
    live.add([4, 5], "de")
    first = Drawn.from_json(live.to_json())
    live.add([6], "f")
    lines = {"t1": [line(delta(first, copy, 7)), line(delta(live, first, 7))]}
    got = resumed({A: {7: copy.to_json()}}, lines, BOUND, NAMES)
    assert got[A].drawn.to_json() == live.to_json()
    assert got[A].base is None


def test_two_tries_from_one_copy_are_two_candidates_never_one_mixed_answer() -> None:
    """A node cut off and healed keeps drawing into its own key while another try goes on from
    the same copy: the longer of the two draws wins whole."""
    copy = drawn([1, 2], "ab")
    cut_off = Drawn.from_json(copy.to_json())
    cut_off.add([10, 11], "xy")
    cut_off_first = Drawn.from_json(cut_off.to_json())
    cut_off.add([12], "z")
    other = Drawn.from_json(copy.to_json())
    other.add([20], "q")
    other_first = Drawn.from_json(other.to_json())
    other.add([21, 22, 23], "rst")
    lines = {
        "cut": [line(delta(cut_off_first, copy, 3)), line(delta(cut_off, cut_off_first, 3))],
        "other": [line(delta(other_first, copy, 3)), line(delta(other, other_first, 3))],
    }
    got = resumed({A: {3: copy.to_json()}}, lines, BOUND, NAMES)
    assert list(got[A].drawn.ids) == [1, 2, 20, 21, 22, 23]
    assert got[A].drawn.to_json() == other.to_json()
    # The other try's second line against the cut-off one's first: not the same point.
    lines["other"] = [line(delta(other, other_first, 3))]
    got = resumed({A: {3: copy.to_json()}}, lines, BOUND, NAMES)
    assert got[A].drawn.to_json() == cut_off.to_json()


def test_an_answer_begun_by_a_try_is_rebuilt_from_its_first_token() -> None:
    empty = Drawn(in_reasoning=True)
    live = Drawn(in_reasoning=True)
    live.add([5, 6], "<think>hm")
    got = resumed({}, {"t": [line(delta(live, empty, FROM_START))]}, BOUND, NAMES)
    assert got[A].drawn.to_json() == live.to_json()
    assert got[A].drawn.in_reasoning


def test_a_lost_line_ends_the_answer_before_it() -> None:
    empty = Drawn(in_reasoning=False)
    one = drawn([1], "a")
    two = drawn([1, 2], "ab")
    three = drawn([1, 2, 3], "abc")
    lines = {"t": [line(delta(one, empty, FROM_START)), line(delta(three, two, FROM_START))]}
    got = resumed({}, lines, BOUND, NAMES)
    assert list(got[A].drawn.ids) == [1]


@pytest.mark.parametrize("change", ["staging", "input", "prompt", "base gone"])
def test_lines_of_another_staging_input_prompt_or_a_deleted_copy_are_not_used(change: str) -> None:
    copy = drawn([1, 2], "ab")
    live = Drawn.from_json(copy.to_json())
    live.add([3], "c")
    entry = delta(live, copy, 5)
    copies: dict[Any, Any] = {A: {5: copy.to_json()}}
    bound = BOUND
    if change == "staging":
        bound = "ffff:" + BOUND.split(":")[1]
    elif change == "input":
        bound = BOUND.split(":")[0] + ":" + "0" * 64
    elif change == "prompt":
        entry["id"] = "p9"
    else:
        copies = {A: {6: copy.to_json()}}
    got = resumed(copies, {"t": [line(entry, bound=bound)]}, BOUND, NAMES)
    assert list(got[A].drawn.ids) == [1, 2]
    assert got[A].base is not None
    assert ("p9", 0) not in got


# --- the journal on Redis ----------------------------------------------------------------------


def test_a_tries_lines_rebuild_its_answers_and_a_copy_deletes_them(db: Any) -> None:
    first, second = drawn([1, 2], "ab"), Drawn(in_reasoning=False)
    live = {A: first, B: second}
    journal = Journal(db, "r", "batch-000000", BOUND, NAMES)
    journal.flush(*journal.lines_since(live))
    first.add([3], "c")
    second.add([7, 8], "xy")
    assert journal.flush(*journal.lines_since(live))
    answers, _ = journal.lines_since(live)
    assert answers == []  # nothing new

    lines = drawn_journal.load(db, "r", "batch-000000")
    assert list(lines) == [journal.attempt]
    got = resumed({}, lines, BOUND, NAMES)
    assert got[A].drawn.to_json() == first.to_json()
    assert got[B].drawn.to_json() == second.to_json()

    # A copy of both at part 2: this try's lines go, and the next ones go on from the copy.
    copy = {name: Drawn.from_json(answer.to_json()) for name, answer in live.items()}
    journal.copied(2, [(name, answer, answer.mark()) for name, answer in live.items()], True)
    assert db.exists(journal.key) == 0
    first.add([4], "d")
    assert journal.flush(*journal.lines_since(live))
    lines = drawn_journal.load(db, "r", "batch-000000")
    copies = {name: {2: answer.to_json()} for name, answer in copy.items()}
    got = resumed(copies, lines, BOUND, NAMES)
    assert got[A].drawn.to_json() == first.to_json() and got[A].base is None
    assert got[B].drawn.to_json() == second.to_json() and got[B].base is not None

    drawn_journal.clear(db, "r", "batch-000000")
    assert db.exists(journal.key, keys.drawn_journal_tries_key("r", "batch-000000")) == 0


def test_a_failed_flush_sends_the_same_ids_again_with_the_next() -> None:
    db = MemoryRedis()
    answer = drawn([1], "a")
    live = {A: answer}
    journal = Journal(db, "r", "batch-000000", BOUND, NAMES)
    db.down = True
    assert not journal.flush(*journal.lines_since(live))
    assert drawn_journal.load(db, "r", "batch-000000") == {}  # a failing Redis reads as none
    db.down = False
    answer.add([2], "b")
    assert journal.flush(*journal.lines_since(live))
    got = resumed({}, drawn_journal.load(db, "r", "batch-000000"), BOUND, NAMES)
    assert list(got[A].drawn.ids) == [1, 2]


def test_an_answer_rebuilt_from_lines_is_journaled_only_once_a_copy_holds_it() -> None:
    """Its base is no object in the store: lines going on from it could be read against a
    copy that never held what it was rebuilt from."""
    db = MemoryRedis()
    rebuilt = drawn([1, 2, 3], "abc")
    copied = drawn([9], "z")
    carried = {A: Resumed(rebuilt, None), B: Resumed(copied, (4, copied.mark()))}
    journal = Journal(db, "r", "batch-000000", BOUND, NAMES, carried)
    assert journal.unbased
    rebuilt.add([4], "d")
    copied.add([10], "y")
    answers, after = journal.lines_since({A: rebuilt, B: copied})
    assert [(a["id"], a["base"], a["from"]) for a in answers] == [("p1", 4, 1)]
    journal.flush(answers, after)
    journal.copied(8, [(A, rebuilt, rebuilt.mark())], drop=False)
    assert not journal.unbased
    rebuilt.add([5], "e")
    answers, _ = journal.lines_since({A: rebuilt, B: copied})
    assert [(a["id"], a["base"], a["from"], a["ids"]) for a in answers] == [("p0", 8, 4, [5])]


def test_an_answer_begun_again_here_is_not_journaled_onto_the_one_before() -> None:
    db = MemoryRedis()
    old = drawn([1, 2], "ab")
    journal = Journal(db, "r", "batch-000000", BOUND, NAMES)
    journal.flush(*journal.lines_since({A: old}))
    new = drawn([7], "q")
    answers, _ = journal.lines_since({A: new})
    assert answers == []


@pytest.mark.parametrize(("finish", "ended"), [("stop", True), ("length", True), ("abort", False)])
def test_an_answer_the_engine_finished_is_marked_ended_as_its_last_ids_arrive(
    finish: str, ended: bool
) -> None:
    """Going on from every id of an answer the engine finished would draw past its end (its
    EOS among them): the feeder leaves an ended answer out of every copy and line. An abort
    is a failed try, whose ids the next goes on from."""
    stream = GenerateStream(Drawn(in_reasoning=False))
    stream.feed(b'data: {"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}}')
    assert not stream.drawn.ended
    last = {
        "text": "ab",
        "output_ids": [1, 2],
        "meta_info": {"completion_tokens": 2, "finish_reason": {"type": finish}},
    }
    stream.feed(b"data: " + orjson.dumps(last))
    assert list(stream.drawn.ids) == [1, 2]
    assert stream.drawn.ended is ended
