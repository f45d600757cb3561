"""Token counts and synthetic text: cheap, deterministic stand-ins for a tokenizer.

Counting rule: one token per 4 characters, rounded up (`ceil(len(text) / 4)`, at least 1 for
non-empty text). A chat prompt adds a template overhead per message (role markers) and an
assistant header, like Qwen3's template. Generated text is made of 4-character units ("tok ")
so that counting the generated text gives back the token count the time model produced.
"""

from __future__ import annotations

import zlib
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # <|im_start|>role\n … <|im_end|>\n
ASSISTANT_HEADER_TOKENS = 3  # <|im_start|>assistant\n
NO_THINK_TOKENS = 4  # "<think>\n\n</think>\n\n" the template adds when thinking is off
EOS_TOKEN_ID = 151645  # Qwen3's <|im_end|>: what `matched_stop` names on a natural stop
VOCAB_SIZE = 151_000

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


def synth_ids(seed: int, tokens: int) -> list[int]:
    """Output token ids matching `synth_text`, for /generate's `output_ids`."""
    return [(seed + i * 7919) % VOCAB_SIZE for i in range(tokens)]
