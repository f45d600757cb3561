"""Token counts and synthetic text: cheap, deterministic stand-ins for a tokenizer.

Counting rule: one token per 4 characters, rounded up (`ceil(len(text) / 4)`, at least 1 for
non-empty text). A chat prompt adds a template overhead per message (role markers) and an
assistant header, like Qwen3's template. Generated text is made of 4-character units ("tok ")
so that counting the generated text gives back the token count the time model produced; each
unit is one id of the emulator's tokenizer (`sim/tokenizer.py`), which /generate answers in.
"""

from __future__ import annotations

import zlib
from array import array
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # <|im_start|>role\n … <|im_end|>\n
ASSISTANT_HEADER_TOKENS = 3  # <|im_start|>assistant\n
NO_THINK_TOKENS = 4  # "<think>\n\n</think>\n\n" the template adds when thinking is off
EOS_TOKEN_ID = 151645  # Qwen3's <|im_end|>: what `matched_stop` names on a natural stop

_WORDS = (
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old",
    "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use",
    "sum", "map", "key", "row", "set", "odd", "big", "end", "top", "low", "run", "fit", "add",
)  # fmt: skip
_UNITS = 4096
_CORPUS = "".join(
    (word + " ") if i % 13 else (word[:2] + ". ")  # every unit is 4 characters long
    for i, word in enumerate(_WORDS[(i * 2654435761 >> 7) % len(_WORDS)] for i in range(_UNITS))
)


FILLER_UNITS = tuple(sorted({_CORPUS[i : i + CHARS_PER_TOKEN] for i in range(0, len(_CORPUS), 4)}))


def filler_unit(index: int) -> str:
    """The 4-character unit at `index` of the filler stream (`synth_text` is their run)."""
    at = (index % _UNITS) * CHARS_PER_TOKEN
    return _CORPUS[at : at + CHARS_PER_TOKEN]


def count_tokens(text: str) -> int:
    """Tokens in a piece of text under the 4-characters rule."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def message_text(content: Any) -> str:
    """The text of an OpenAI message content: a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def chat_prompt(messages: list[Any], thinking: bool) -> tuple[str, int]:
    """The prompt key (what the completion length hashes) and its token count."""
    texts: list[str] = []
    tokens = ASSISTANT_HEADER_TOKENS + (0 if thinking else NO_THINK_TOKENS)
    for message in messages:
        text = message_text(message.get("content")) if isinstance(message, dict) else ""
        role = str(message.get("role", "")) if isinstance(message, dict) else ""
        texts.append(role)
        texts.append(text)
        tokens += count_tokens(text) + MESSAGE_OVERHEAD_TOKENS
    return "\x00".join(texts), tokens


def prompt_seed(key: str, salt: int = 0) -> int:
    """A 32-bit seed for everything derived from one prompt (length, accepts, text)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass"), salt & 0xFFFFFFFF)


def prompt_ids_seed(ids: list[int]) -> int:
    """`prompt_seed` of a prompt given as token ids: every id counts, so two prompts that
    share a long system prompt still differ."""
    try:
        raw = array("I", ids).tobytes()
    except OverflowError:  # an id beyond 32 bits: no real vocabulary has one, but never crash
        raw = repr(ids).encode()
    return zlib.crc32(raw)


def synth_text(seed: int, tokens: int, start: int = 0) -> str:
    """`tokens` tokens of filler text, the slice [start, start + tokens) of a seeded stream."""
    if tokens <= 0:
        return ""
    offset = (seed + start) % _UNITS
    begin, end = offset * CHARS_PER_TOKEN, (offset + tokens) * CHARS_PER_TOKEN
    if end <= len(_CORPUS):
        return _CORPUS[begin:end]
    repeats = end // len(_CORPUS) + 1
    return (_CORPUS * repeats)[begin:end]


# --- answers that repeat: loops the repetition guard must stop, structure it must not -------

LEGIT_KINDS = ("table", "list", "code", "refrain", "enumeration")
LOOP_BLOCK_TOKENS = (3, 5, 12, 30, 75, 150, 200, 300, 375)  # 12 … 1,500 characters
LOOP_START_TOKENS = (64, 1200)  # a loop begins this many tokens in, at the earliest and latest
_CHORUS = "Oh the night is long and the road goes on, so we sing it again until the dawn.\n"
_legit_cache: dict[tuple[str, int], str] = {}
_MASK64 = 2**64 - 1


def _draw(seed: int, salt: int) -> float:
    """A uniform [0, 1) draw of the prompt's seed, independent of its length's draws and of
    its other draws (splitmix64's finaliser: a CRC is linear, so draws of one seed under two
    salts would move together, and every looping prompt would loop the same way)."""
    x = (seed ^ (salt * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) / 2**64


def draw_text_kind(seed: int, loop_rate: float, legit_rate: float) -> str:
    """The kind of answer of the prompt with this seed: `loop`, one of LEGIT_KINDS or
    `plain`, at the given rates."""
    u = _draw(seed & 0xFFFFFFFF, 0x5EED)
    if u < loop_rate:
        return "loop"
    if u < loop_rate + legit_rate:
        return LEGIT_KINDS[int(_draw(seed & 0xFFFFFFFF, 0x1E617) * len(LEGIT_KINDS))]
    return "plain"


def draw_loop(seed: int, target_tokens: int) -> tuple[int, int]:
    """(the token the loop begins at, its block in tokens) for a looping prompt."""
    low, high = LOOP_START_TOKENS
    start = low + int(_draw(seed & 0xFFFFFFFF, 0x100F) * (high - low))
    block = LOOP_BLOCK_TOKENS[int(_draw(seed & 0xFFFFFFFF, 0xB10C) * len(LOOP_BLOCK_TOKENS))]
    return max(0, min(start, target_tokens - 1)), block


LOOP_BLOCK_SALT = 0x2F6B


def loop_block_start(seed: int, block_tokens: int) -> int:
    """Where in the filler stream a loop's block starts: the first shift whose block's
    shortest period is its own length (so the loop repeats the whole block)."""
    for shift in range(64):
        block = synth_text(seed ^ LOOP_BLOCK_SALT, block_tokens, start=shift)
        if (block + block).find(block, 1) == len(block):
            return (seed ^ LOOP_BLOCK_SALT) + shift
    raise AssertionError("no aperiodic block")  # filler text is never this regular


def loop_block(seed: int, block_tokens: int) -> str:
    """The block a loop repeats: filler whose shortest period is its own length."""
    return synth_text(loop_block_start(seed, block_tokens), block_tokens)


def loop_text(seed: int, tokens: int, start_tokens: int, block_tokens: int) -> str:
    """`tokens` tokens of an answer that turns at `start_tokens` into one block repeated."""
    if tokens <= start_tokens:
        return synth_text(seed, tokens)
    block = loop_block(seed, block_tokens)
    looped = tokens - start_tokens
    copies = looped // block_tokens + 1
    return synth_text(seed, start_tokens) + (block * copies)[: looped * CHARS_PER_TOKEN]


def _word(i: int) -> str:
    return _WORDS[(i * 2654435761 >> 5) % len(_WORDS)]


def legit_line(kind: str, i: int, variant: int) -> str:
    """Line `i` of a legitimately repetitive answer: the structure repeats, the content not."""
    if kind == "table":
        head = "| # | name | value | note |\n|---|------|-------|------|\n" if i == 0 else ""
        return head + f"| {i} | {_word(i)} | {(i * 37 + variant) % 1000} | {_word(i * 7 + 3)} |\n"
    if kind == "list":
        return f"{i + 1}. Check that the {_word(i)} {_word(i * 3 + 1)} is {_word(i * 5 + 2)}.\n"
    if kind == "code":
        return f"    if key == {i}:\n        return handle_{_word(i)}(value, {i * 3 + variant})\n"
    if kind == "refrain":
        verse = f"Verse {i + 1}: the {_word(i)} and the {_word(i * 3)} went {_word(i * 7)}.\n"
        return verse + _CHORUS
    return f"item {i + variant}, "


def legit_text(kind: str, seed: int, tokens: int) -> str:
    """`tokens` tokens of a table, a numbered list, code, a song with its refrain or a long
    enumeration: repetition a person wants, which the guard must never stop."""
    chars = max(0, tokens) * CHARS_PER_TOKEN
    key = (kind, seed % 5)
    text = _legit_cache.get(key, "")
    if len(text) < chars:
        lines: list[str] = []
        size, i = 0, 0
        want = max(chars, 2 * len(text), 16384)
        while size < want:
            line = legit_line(kind, i, key[1])
            lines.append(line)
            size += len(line)
            i += 1
        text = _legit_cache[key] = "".join(lines)
    return text[:chars]
