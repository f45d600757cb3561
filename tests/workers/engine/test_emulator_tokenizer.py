"""The emulator's tokenizer, its split of ids into prompt and drawn output, and the answer
writer: pure functions, table tests (the HTTP contract is in test_emulator_tokenize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genfleet.workers.engine.emulator.sim.answer import Answer, Plan, Writer
from genfleet.workers.engine.emulator.sim.chat_template import BUILT_IN, ChatTemplate
from genfleet.workers.engine.emulator.sim.generation_prompt import Family, Start, derive
from genfleet.workers.engine.emulator.sim.text import LEGIT_KINDS, count_tokens
from genfleet.workers.engine.emulator.sim.tokenizer import (
    LAYOUT,
    QWEN3_SPECIALS,
    SimTokenizer,
    ordinary_base,
)

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
DEEPSEEK_VARS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
CHATML = (  # a template with no thinking switch (as the real-SGLang test checkpoints carry)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROSE = (
    "The quick brown fox jumps over the lazy dog. In this example, we show how the function "
    "returns a value that is used by the next step of the process. However, there are many "
    "different ways to write the same code, and it is important to think about which one "
    "would be the most readable for other people who will maintain it after you."
)
TOK = SimTokenizer()


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_decode_of_encode_is_the_text(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


@pytest.mark.parametrize("special", sorted(TOK.specials))
def test_a_special_token_in_text_is_one_id(special: str) -> None:
    ids = TOK.encode(f"a{special}b")
    assert TOK.specials[special] in ids and len(ids) == 3
    assert TOK.piece(TOK.specials[special]) == special


def test_qwen3_ids_are_qwen3s_and_ordinary_ids_stay_below_them() -> None:
    assert {s: TOK.specials[s] for s in QWEN3_SPECIALS} == {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<think>": 151667,
        "</think>": 151668,
    }
    assert TOK.eos_id == 151645
    ids = TOK.encode(PROSE + "\u00e9\u4f60\U0001f600" * 50 + "".join(map(chr, range(32, 127))))
    assert max(ids) < min(TOK.specials.values())
    assert max(TOK.base + LAYOUT.size - 1, 0) < min(QWEN3_SPECIALS.values())


def test_english_runs_three_to_four_characters_an_id_near_the_chat_count() -> None:
    ids = TOK.encode(PROSE)
    assert 3.0 <= len(PROSE) / len(ids) <= 4.0
    assert 0.8 <= count_tokens(PROSE) / len(ids) <= 1.2


@pytest.mark.parametrize(
    ("specials", "size", "base"),
    [
        ([151643, 151644], 1000, 0),  # Qwen3: the block fits below the specials
        ([0, 1, 128798, 128799], 1000, 2),  # DeepSeek-like: after BOS 0 and EOS 1
        ([0, 1, 5], 10, 6),  # no room between them: after the last one in the way
        ([], 10, 0),
    ],
)
def test_ordinary_block_holds_no_special_id(specials: list[int], size: int, base: int) -> None:
    assert ordinary_base(specials, size) == base


def test_specials_and_eos_come_from_the_checkpoint(tmp_path: Path) -> None:
    added = {
        "0": {"content": "<｜begin▁of▁sentence｜>", "special": True},
        "1": {"content": "<｜end▁of▁sentence｜>", "special": True},
        "128798": {"content": "<think>", "special": False},
        "128799": {"content": "</think>", "special": False},
        "128803": {"content": "<｜User｜>", "special": False},
        "128804": {"content": "<｜Assistant｜>", "special": False},
    }
    config = {
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>"},
        "eos_token": {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>"},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = SimTokenizer.from_checkpoint(str(tmp_path))
    assert tok.eos_id == 1 and tok.base == 2
    text = "<｜User｜>Hello there<｜Assistant｜><think>"
    ids = tok.encode(text)
    assert ids[0] == 128803 and ids[-2:] == [128804, 128798]
    assert all(2 <= i < 128798 for i in ids[1:-2])
    assert tok.encode(text, add_special_tokens=True) == [0, *ids]
    assert tok.decode(ids) == text
    assert SimTokenizer.from_checkpoint(str(tmp_path / "missing")).specials == TOK.specials


def family(name: str) -> Family:
    if name == "built-in":
        return derive(ChatTemplate(BUILT_IN, name), TOK)
    if name == "chatml":
        return derive(ChatTemplate(CHATML, name), TOK)
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return derive(ChatTemplate(source, name, DEEPSEEK_VARS), TOK)


@pytest.mark.parametrize(
    ("name", "prompts", "after_think"),
    [
        ("qwen3", {"<|im_start|>assistant\n": "think_first",
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n": "content"}, "\n\n"),
        ("built-in", {"<|im_start|>assistant\n": "think_first",
                      "<|im_start|>assistant\n<think>\n\n</think>\n\n": "content"}, "\n\n"),
        ("qwen3_5", {"<|im_start|>assistant\n<think>\n": "reasoning",
                     "<|im_start|>assistant\n<think>\n\n</think>\n\n": "content"}, "\n\n"),
        ("deepseek_v3_1", {"<｜Assistant｜><think>": "reasoning",
                           "<｜Assistant｜></think>": "content"}, ""),
        ("chatml", {"<|im_start|>assistant\n": "content"}, ""),
    ],
)  # fmt: skip
def test_generation_prompts_come_from_the_template(
    name: str, prompts: dict[str, str], after_think: str
) -> None:
    fam = family(name)
    assert {TOK.decode(p.ids): p.start for p in fam.prompts} == prompts
    assert fam.after_think == after_think


QWEN3_CHAT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
THINK, END, NL2 = TOK.specials["<think>"], TOK.specials["</think>"], TOK.word_id("\n\n")
DRAWN = [TOK.word_id("the "), TOK.word_id("and ")]


@pytest.mark.parametrize(
    ("name", "prompt", "drawn", "start"),
    [
        # Qwen3, thinking on: the header alone; the model's own <think> is drawn output
        ("qwen3", QWEN3_CHAT + "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n",
         [], "think_first"),
        ("qwen3", "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n",
         [THINK, *DRAWN], "think_first"),
        ("qwen3", "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n",
         [THINK, *DRAWN, END, NL2, *DRAWN], "think_first"),
        # Qwen3, thinking off: the closed empty block is prompt
        ("qwen3", "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
         DRAWN, "content"),
        # Qwen3.5: <think>\n opened by the template
        ("qwen3_5", "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n<think>\n",
         [*DRAWN, END, NL2, *DRAWN], "reasoning"),
        ("qwen3_5", "<|im_start|>user\nOk?<|im_end|>\n<|im_start|>assistant\n"
         "<think>\n\n</think>\n\n", [], "content"),
        ("deepseek_v3_1", "<｜begin▁of▁sentence｜><｜User｜>Ok?<｜Assistant｜><think>",
         [*DRAWN, END, *DRAWN], "reasoning"),
        ("deepseek_v3_1", "<｜begin▁of▁sentence｜><｜User｜>Ok?<｜Assistant｜></think>",
         DRAWN, "content"),
        # no generation prompt at all (a raw text prompt): all of it is prompt
        ("qwen3", "The capital of France is", [], "content"),
    ],
)  # fmt: skip
def test_split_at_the_last_generation_prompt(
    name: str, prompt: str, drawn: list[int], start: str
) -> None:
    prompt_ids = TOK.encode(prompt)
    split = family(name).split(prompt_ids + drawn)
    assert (split.prompt_len, split.drawn, split.start) == (len(prompt_ids), len(drawn), start)


@pytest.mark.parametrize("start", ["think_first", "reasoning", "content"])
@pytest.mark.parametrize("kind", ["plain", "loop", *LEGIT_KINDS])
def test_an_answer_is_the_same_from_any_cut(start: Start, kind: str) -> None:
    writer = Writer(TOK, "\n\n")
    if kind == "loop":
        plan = Plan.looping(1234, 300, start, 70, 12)
    else:
        plan = Plan(seed=1234, total=300, start=start, reasoning=120, kind=kind)
    whole = Answer(writer, plan, 0)
    whole.upto(plan.total)
    for cut in (0, 1, 2, 118, 119, 120, 121, 299):
        rest = Answer(Writer(TOK, "\n\n"), plan, cut)
        rest.upto(plan.total - cut)
        assert whole.ids[:cut] + rest.ids == whole.ids
        assert whole.text(0, cut) + rest.text(0, plan.total - cut) == whole.text(0, plan.total)
    assert "".join(whole.pieces) == TOK.decode(whole.ids)
    assert not set(whole.ids) & (set(TOK.specials.values()) - {THINK, END})
    if start == "think_first":
        assert whole.ids[0] == THINK
    if start != "content" and kind != "loop":
        assert whole.ids.count(END) == 1 and whole.ids[whole.ids.index(END) + 1] == NL2
    else:
        assert END not in whole.ids and THINK not in whole.ids[1:]
