"""The repetition guard on tables: loops of every block size, down to one character, are
caught within 2,000 tokens of their start; text that repeats legitimately, or as its prompt
holds or asks, is never stopped; on the labelled corpus of real texts, no false stop and at
least 95 % of loops caught in time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from genfleet.workers.engine.emulator.sim.text import LEGIT_KINDS, legit_text, synth_text
from genfleet.workers.feeding.repetition import (
    AnswerGuard,
    Loop,
    RepetitionDetector,
    RepetitionRule,
    asked_copies,
    in_prompt,
    prompt_text,
    token_estimate,
)
from harness.repetition_corpus import BUDGET_TOKENS, load_corpus, score

RULE = RepetitionRule()
CHUNK_CHARS = 128  # SGLang with --stream-interval 32 (coarser than genfleet's 8), 4 chars a token
CHARS_PER_TOKEN = 4


def stream(
    text: str, rule: RepetitionRule = RULE, chunk: int = CHUNK_CHARS, prompt: str = ""
) -> Loop | None:
    """Feed `text` in chunks; the loop found, if any (the stream stops there)."""
    detector = RepetitionDetector(rule, prompt)
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


def ascii_rules() -> str:
    sections = (f"Part {i}\n" + "=" * 120 + "\n" + PROSE + "-" * 300 + "\n" for i in range(12))
    return PROSE + "".join(sections)  # rules between sections, not loops


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
    "ascii rules": ascii_rules(),
    "counting": "".join(f"Step {i}: wait, check it again.\n" for i in range(1, 1200)),
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
        {"short_span_chars": 10},
    ],
)
def test_impossible_rules_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="repetition_"):
        RepetitionRule(**kwargs)


@pytest.mark.parametrize(
    "block",
    ["\n", "ha ", "....", " the", "\\", "b ", ")", "0", "ab", "<td></td>", "啊", "好的 "],
)
@pytest.mark.parametrize("chunk", [1, 37, CHUNK_CHARS])
def test_short_period_loops_are_stopped(block: str, chunk: int) -> None:
    """A block under `min_block_chars` ("\\n", "ha ", "....") is a degenerate loop once
    `short_span_chars` of it have streamed: within 2,000 tokens even at a token a copy."""
    prefix = PROSE * 3
    text = prefix + block * (20_000 // len(block))
    loop = stream(text, chunk=chunk)
    assert loop is not None
    assert loop.rule == "short"
    assert len(block) % loop.block_chars == 0 and loop.block_chars <= len(block)
    assert len(prefix) - len(block) <= loop.start_char <= len(prefix)
    copies = (loop.chars - len(prefix)) / len(block)
    assert copies <= BUDGET_TOKENS  # a token a copy at the most
    assert token_estimate(text[len(prefix) : loop.chars]) <= 400


@pytest.mark.parametrize(
    "text",
    [
        PROSE + "=" * 900 + "\n" + PROSE,  # a long rule, under the short span
        PROSE + "ha " * 250 + PROSE,  # a laugh of 750 characters
        PROSE + " " * 600 + PROSE,  # padding
        "".join(f"| a | b |\n|---|---|\n| {i} | {i * i} |\n" + PROSE for i in range(20)),
    ],
)
def test_short_runs_under_the_short_span_are_not_loops(text: str) -> None:
    assert stream(text) is None


@pytest.mark.parametrize("chunk", [CHUNK_CHARS, 1000])
def test_a_block_holding_a_long_run_of_a_short_period_is_found(chunk: int) -> None:
    """Copies of the last characters inside a run of "ISIS-" name only multiples of 5; the
    guard anchors on the run's start and finds the block's own period."""
    block = "ISIS-" * 25 + "SIS-" + "ISIS-" * 36 + "\n"
    loop = stream(PROSE + block * 40, chunk=chunk)
    assert loop is not None and loop.block_chars == len(block)
    assert loop.chars - len(PROSE) <= RULE.span_chars(len(block)) + chunk + len(block)


def test_a_cjk_loop_is_stopped_after_as_many_tokens_as_an_english_one() -> None:
    block = "大连是一个综合性的城市，其中包括商业、科技、文化、教育、医疗、服务等多方面。\n"
    loop = stream(PROSE + block * 400)
    assert loop is not None and loop.block_chars == len(block)
    assert token_estimate((PROSE + block * 400)[len(PROSE) : loop.chars]) <= 1000


@pytest.mark.parametrize(
    ("prompt", "copies"),
    [
        ("Write 'I will not talk in class.' 150 times.", 300),
        ("An HTML row with 400 empty cells.", 800),
        ("Write 1/17 as a decimal to 4,000 digits.", 8000),
        ("Draw an empty 60x60 grid.", 7200),
        ("A C array of 4096 zero bytes.", 8192),
        ("Make a 300-row table of zeros.", 600),
        ("Say it over and over.", float("inf")),
        ("重复这句话", float("inf")),
        ("Write it 20 遍", 40),
        ("Can you repeat your key design decisions?", 0),  # restating is no repetition
        ("Question 12: list the first 12 primes and explain.", 0),
        ("Tabulate 5 facts.", 0),
        ("What is 7 times 8?", 0),  # a product, not a count of copies
        ("", 0),
    ],
)
def test_what_the_prompt_asks_for(prompt: str, copies: float) -> None:
    assert asked_copies(prompt) == copies


@pytest.mark.parametrize(
    ("block", "prompt", "short", "held"),
    [
        (
            "INSERT INTO t VALUES (7, 'x');\n",
            "Seed it: INSERT INTO t VALUES (1, 'x');",
            False,
            True,
        ),
        ("I will not talk in class.\n", "write: i will not talk in class.", False, True),
        ("<td></td>", "Cells like <td></td><td></td> please", True, True),
        ("<td></td>", "Cells like <td></td> please", True, False),  # one copy: not the run
        ("\n", "\n\n\n\n\n", True, False),  # whitespace is never the prompt's text
        (" the", "the the the the the", True, True),  # the prompt's own run
        (" the", "the cat and the dog", True, False),
        ("ha ", "ha ha", True, False),  # under 8 characters of text
        ("The user asks: sum it.\nI am not sure.\n", "sum it.", False, False),  # one line
    ],
)
def test_what_the_prompt_holds(block: str, prompt: str, short: bool, held: bool) -> None:
    from genfleet.workers.feeding.repetition import PromptAllowance

    assert in_prompt(block, PromptAllowance(prompt).normalized, short) is held


@pytest.mark.parametrize(
    ("prompt", "text", "stopped"),
    [
        (
            "Write 'I will not talk in class.' 150 times.",
            "I will not talk in class.\n" * 150,
            False,
        ),
        (
            "Write 'I will not talk in class.' 150 times.",
            "I will not talk in class.\n" * 2000,
            True,
        ),
        ("Write 1/17 to 4,000 digits.", "0." + "0588235294117647" * 250, False),
        ("Draw an empty 60x60 grid of dots.", ("." * 60 + "\n") * 60, False),
        ("Laugh like this: ha ha ha ha ha ha", "ha " * 2000, False),
        ("", "I will not talk in class.\n" * 150, True),  # no prompt: a loop
        ("Tell me a joke.", "ha " * 2000, True),
    ],
)
def test_repetition_the_prompt_asks_for_or_holds_is_not_stopped(
    prompt: str, text: str, stopped: bool
) -> None:
    loop = stream(text, prompt=prompt)
    assert (loop is not None) is stopped
    if loop is not None and prompt:  # an overshoot: more copies than asked, counted in full
        assert loop.repeats > asked_copies(prompt)


def test_a_run_longer_than_the_tail_is_counted_whole() -> None:
    """Copies are counted from the first one, far beyond the tail the detector keeps: a
    prompt's count holds however long the run."""
    line = "I will not talk in class.\n"
    detector = RepetitionDetector(RULE, "Write it 1000 times.")  # up to 2,000 copies
    stops = [detector.feed(line * 10) for _ in range(300)]  # 3,000 copies, 78,000 characters
    stop = next(found for found in stops if found is not None)
    assert stop.start_char == 0
    assert 2000 < stop.repeats <= 2020  # stopped at the first check past the count
    assert detector.tail_chars < 3 * RULE.keep_chars


def test_prompt_text_reads_every_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Say hi 3 times."}, {"type": "image_url"}],
        },
    ]
    assert prompt_text(messages) == "Be brief.\nSay hi 3 times."


def test_the_loop_record_holds_its_evidence() -> None:
    block = block_of(97)
    loop = stream(PROSE + block * 100)
    assert loop is not None
    figures = loop.to_json()
    assert figures["block_chars"] == 97 and figures["rule"] == "block"
    assert figures["block"] in block + block and len(figures["block"]) <= 120
    assert figures["start_char"] == loop.start_char and figures["repeats"] >= 8


@pytest.mark.parametrize("chunk", [37, CHUNK_CHARS, 1000])
def test_on_the_corpus_of_real_texts_no_false_stop_and_loops_caught_in_time(chunk: int) -> None:
    texts = load_corpus()
    assert (
        sum(t.label == "legit" for t in texts) >= 30 and sum(t.label == "loop" for t in texts) >= 20
    )
    figures = score(texts, lambda prompt: RepetitionDetector(RULE, prompt), chunk=chunk)
    assert figures.false_stops == []
    assert figures.catch_share >= 0.95, (figures.missed, figures.late)


@pytest.mark.parametrize("block_chars", [12, 400, 1500])
def test_where_a_loop_is_found_does_not_depend_on_how_the_stream_was_cut(block_chars: int) -> None:
    # An engine sends what piled up while its reader lagged as one piece: the loop is found
    # where small pieces would have found it, not at the end of the piece.
    text = PROSE * 5 + block_of(block_chars) * (40_000 // block_chars)
    small = stream(text, chunk=128)
    whole = stream(text, chunk=len(text))
    assert small is not None and whole is not None
    assert abs(whole.chars - small.chars) <= RULE.check_every_chars
    assert whole.chars < len(text) - RULE.check_every_chars


def test_an_answers_guard_keeps_the_first_loop_of_either_field() -> None:
    loop = "Wait, let me recount the odd numbers once more from the start. " * 200
    guard = AnswerGuard(RULE)
    stopped = [
        guard.feed(loop[at : at + CHUNK_CHARS], "") for at in range(0, len(loop), CHUNK_CHARS)
    ]
    assert stopped.count(True) == 1 and guard.loop_field == "reasoning"
    found = guard.loop
    assert not guard.feed("", loop) and guard.loop is found  # nothing fed after it
    off = AnswerGuard()
    assert not off.on and not off.feed(loop, loop) and off.loop is None


def test_an_answers_detectors_are_built_by_its_guard_alone() -> None:
    """Both ways of drawing an answer (the chat stream, ids from /generate) keep their
    guard's state in one `AnswerGuard`: no other module builds a RepetitionDetector."""
    workers = Path(__file__).resolve().parents[2] / "workers"
    builders = []
    for path in sorted(workers.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name == "RepetitionDetector":
                builders.append(path.relative_to(workers).as_posix())
    assert set(builders) == {"feeding/repetition.py"}
