"""The repetition guard on a table: loops of every block size are caught within 2,000 tokens
of their start; text that repeats legitimately is never stopped."""

from __future__ import annotations

import pytest

from genfleet.workers.engine.emulator.sim.text import LEGIT_KINDS, legit_text, synth_text
from genfleet.workers.feeding.repetition import Loop, RepetitionDetector, RepetitionRule

RULE = RepetitionRule()
CHUNK_CHARS = 128  # what SGLang streams with --stream-interval 32, at 4 characters a token
CHARS_PER_TOKEN = 4


def stream(text: str, rule: RepetitionRule = RULE, chunk: int = CHUNK_CHARS) -> Loop | None:
    """Feed `text` in chunks; the loop found, if any (the stream stops there)."""
    detector = RepetitionDetector(rule)
    for at in range(0, len(text), chunk):
        loop = detector.feed(text[at : at + chunk])
        if loop is not None:
            return loop
    return None


def block_of(chars: int) -> str:
    """A block whose shortest period is its own length."""
    text = synth_text(11, chars // 4 + 2)
    for start in range(64):
        block = (text + text)[start : start + chars]
        if (block + block).find(block, 1) == chars:
            return block
    raise AssertionError("no aperiodic block")


PROSE = (
    "To find the sum of the first n odd numbers we can pair them from both ends. The first "
    "and the last add to 2n, the second and the second last too, and there are n/2 pairs. "
)


def code() -> str:
    lines = ["def dispatch(key: int, value: str) -> str:"]
    for i in range(400):
        lines.append(f"    if key == {i}:\n        return handle_{i % 7}(value, offset={i * 3})")
    return "\n".join(lines)


def markdown_table() -> str:
    rows = ["| year | revenue | margin | note |", "|------|---------|--------|------|"]
    rows += [f"| {1900 + i} | {i * 1234 % 9973} | {i * 7 % 100}% | n/a |" for i in range(600)]
    return "\n".join(rows)


def numbered_list() -> str:
    return "\n".join(f"{i}. Check the value of x again." for i in range(1, 600))


def refrain() -> str:
    chorus = "And the river runs, and the river sings, and we follow it home again.\n"
    return "".join(f"Verse {i}: we walked {i} miles along its bank.\n" + chorus for i in range(80))


def enumeration() -> str:
    return ", ".join(f"the element number {i}" for i in range(2000))


def ascii_rule() -> str:
    return PROSE + "=" * 5000 + "\n" + PROSE  # a short-period run is not a block loop


def quoted_paragraph() -> str:
    """A 1,500-character paragraph quoted three times, verbatim, between prose: a long block
    needs a fourth copy (6,000 characters of it) before it is a loop."""
    paragraph = block_of(1500)
    return PROSE * 10 + paragraph * 3 + PROSE * 10


LEGITIMATE = {
    "prose": PROSE + synth_text(7, 30_000),
    "code": code(),
    "markdown table": markdown_table(),
    "numbered list": numbered_list(),
    "refrain": refrain(),
    "long enumeration": enumeration(),
    "ascii rule": ascii_rule(),
    "paragraph quoted three times": quoted_paragraph(),
    **{f"emulator {kind}": legit_text(kind, 3, 20_000) for kind in LEGIT_KINDS},
}


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_repetition_is_never_stopped(name: str) -> None:
    text = LEGITIMATE[name]
    assert len(text) > RULE.min_span_chars + RULE.max_block_chars, name
    assert stream(text) is None


@pytest.mark.parametrize("block_chars", [10, 13, 40, 97, 256, 500, 800, 900, 1200, 1500])
@pytest.mark.parametrize("chunk", [1, 37, CHUNK_CHARS, 300])
def test_loops_are_caught_within_2000_tokens_of_their_start(block_chars: int, chunk: int) -> None:
    prefix = PROSE * 5
    block = block_of(block_chars)
    text = prefix + block * (40_000 // block_chars)
    loop = stream(text, chunk=chunk)
    assert loop is not None
    assert loop.block_chars == block_chars
    assert len(prefix) - block_chars < loop.start_char <= len(prefix)
    assert (loop.chars - len(prefix)) / CHARS_PER_TOKEN <= 2000
    assert loop.repeats * block_chars >= RULE.span_chars(block_chars)
    assert loop.repeats >= min(RULE.min_repeats, 3)  # never fewer than three copies


@pytest.mark.parametrize(
    ("rule", "block_chars", "span"),
    [
        (RULE, 10, 3000),  # short blocks: the minimum span
        (RULE, 375, 3000),
        (RULE, 500, 4000),  # eight copies
        (RULE, 750, 6000),
        (RULE, 1000, 6000),  # long blocks: the maximum span, four to six copies
        (RULE, 1500, 6000),
        (RepetitionRule(max_span_chars=20_000), 1500, 12_000),  # eight copies fit
        (RepetitionRule(min_repeats=2), 1500, 3000),  # fewer copies asked: those
        (RepetitionRule(max_span_chars=3000), 1500, 4500),  # never fewer than three
    ],
)
def test_the_span_a_block_needs(rule: RepetitionRule, block_chars: int, span: int) -> None:
    assert rule.span_chars(block_chars) == span


def test_a_loop_is_caught_however_long_the_answer_before_it() -> None:
    prefix = synth_text(3, 100_000)  # 400,000 characters of answer, then a loop
    block = block_of(120)
    loop = stream(prefix + block * 100)
    assert loop is not None and abs(loop.start_char - len(prefix)) < 120


def test_the_thresholds_are_settings() -> None:
    block = block_of(60)
    text = PROSE + block * 30  # 1,800 characters of loop: under the default span
    assert stream(text) is None
    loose = RepetitionRule(min_span_chars=1000, min_repeats=8, check_every_chars=64)
    assert stream(text, loose) is not None
    narrow = RepetitionRule(min_span_chars=1000, max_block_chars=50, check_every_chars=64)
    assert stream(text, narrow) is None  # its block is above the longest one looked for


def test_the_tail_kept_is_bounded_whatever_the_length() -> None:
    detector = RepetitionDetector(RULE)
    text = synth_text(5, 1_000_000)
    for at in range(0, len(text), CHUNK_CHARS):
        detector.feed(text[at : at + CHUNK_CHARS])
        assert detector.tail_chars <= 2 * RULE.keep_chars + RULE.check_every_chars + CHUNK_CHARS
    assert detector.chars == len(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_block_chars": 0},
        {"min_block_chars": 200, "max_block_chars": 100},
        {"min_repeats": 1},
        {"min_span_chars": 3000, "max_span_chars": 2000},
    ],
)
def test_impossible_rules_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="repetition_"):
        RepetitionRule(**kwargs)
