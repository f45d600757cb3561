"""The emulator's tokenizer: reversible, special tokens as single ids, ~3.5 characters an id.

Why this design: the emulator has no vocabulary file, yet token ids must behave like a real
tokenizer's for the path that continues a cut answer token-exactly (the worker renders a prompt
through `/v1/tokenize`, then streams `/generate` with ids): `decode(encode(text)) == text` for
any text, every special token a single id, ordinary ids never equal to a special one, and a
count close to the chat route's 4-characters rule. A packing of characters into ids gives all
of that with no data file and a fixed cost per character:

- ids 0..255 of the ordinary block are single bytes (any text falls back to its UTF-8 bytes);
- then a word table: the filler units the emulator writes (`sim/text.py`), the roles, `\\n\\n`
  and frequent English words with their leading space, each one id;
- then every pair and every triple of characters of a 48-character alphabet (lower-case
  letters, digits, space, newline and common punctuation), one id each.

Encoding is greedy: a special token; else the longest word; else three, two alphabet
characters; else the character's bytes. English prose comes out at about 3.5 characters an id
(capitals and rarer characters cost a byte id each). Any split of a text concatenates back to
its bytes, so decoding is exact whatever the ids.

Special tokens and their ids come from the checkpoint's `tokenizer_config.json`
(`added_tokens_decoder`) when the model path is a local directory that has one; else Qwen3's
real ids for its five (`<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645,
`<think>` 151667, `</think>` 151668) and emulator-assigned ids after them for DeepSeek's four
role markers (so a DeepSeek template renders to single ids too). The ordinary block is placed
at the lowest ids that hold no special id: below the smallest one for Qwen3's layout, after
DeepSeek's `<｜begin▁of▁sentence｜>` 0 and `<｜end▁of▁sentence｜>` 1 for theirs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genfleet.workers.engine.emulator.sim.text import FILLER_UNITS

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,'-:?!()\""
QWEN3_SPECIALS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<think>": 151667,
    "</think>": 151668,
}
# Not Qwen3's: ids the emulator gives DeepSeek's role markers when no checkpoint names them.
EMULATOR_SPECIALS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
)
DEFAULT_EOS = "<|im_end|>"
# Marked `special` (what `skip_special_tokens` drops) among the defaults, as in the real configs.
DEFAULT_SKIPPED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *EMULATOR_SPECIALS[:2])
THINK_START, THINK_END = "<think>", "</think>"
_WORDS = (
    "assistant", "user", "system", "tool", "\n\n", "\n\n\n",
    " the", " and", " that", " with", " for", " this", " from", " have", " are", " was",
    " not", " you", " your", " they", " their", " there", " which", " what", " when",
    " where", " will", " would", " should", " could", " can", " about", " into", " than",
    " then", " them", " these", " those", " some", " more", " most", " other", " only",
    " also", " been", " being", " were", " each", " such", " like", " just", " over",
    " under", " after", " before", " between", " through", " during", " without", " while",
    " because", " however", " example", " number", " answer", " question", " function",
    " value", " values", " return", " result", " data", " list", " file", " line", " code",
    " time", " first", " second", " last", " next", " new", " old", " one", " two", " three",
    " make", " made", " used", " using", " use", " need", " know", " think", " want", " write",
    " give", " find", " take", " help", " show", " name", " part", " point", " case", " form",
    " here", " how", " why", " who", " its", " it's", " is", " it", " in", " of", " to", " a",
    " an", " as", " at", " be", " by", " or", " on", " so", " if", " we", " he", " she",
    " all", " any", " may", " must", " our", " out", " up", " do", " does", " did", " has",
    " had", " his", " her", " him", " very", " well", " many", " much", " same", " different",
    " following", " information", " important", " possible", " problem", " system",
    " because", " people", " world", " water", " string", " input", " output", " model",
    " process", " step", " steps", " final", " total", " given", " let", " let's",
    "The", "This", "That", "There", "It", "In", "If", "We", "You", "I", "A", "For", "What",
    "How", "Here", "To", "Okay", "So", " The", " This", " I", " A", " In", " It",
    "ing", "tion", "ment", "ness", "able", "ed ", "s, ", ". ", ", ", ".\n", ":\n", "**",
    "    ", "        ",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each kind of ordinary id lies, as offsets into the ordinary block."""

    words: tuple[bytes, ...]
    pairs_at: int
    triples_at: int
    size: int


def _layout() -> _Layout:
    seen: dict[bytes, None] = {}
    for word in (*FILLER_UNITS, *_WORDS):
        raw = word.encode()
        if len(raw) > 1:  # single characters are their byte
            seen.setdefault(raw, None)
    words = tuple(seen)
    pairs_at = 256 + len(words)
    triples_at = pairs_at + len(ALPHABET) ** 2
    return _Layout(words, pairs_at, triples_at, triples_at + len(ALPHABET) ** 3)


LAYOUT = _layout()


class SimTokenizer:
    """encode/decode over the emulator's vocabulary (see the module docstring).

    Examples:
        tok = SimTokenizer.from_checkpoint("/models/Qwen3-8B")   # or SimTokenizer()
        ids = tok.encode("<|im_start|>user\\nHi<|im_end|>\\n")
        assert tok.decode(ids) == "<|im_start|>user\\nHi<|im_end|>\\n"
    """

    def __init__(
        self,
        specials: dict[str, int] | None = None,
        *,
        skipped: Iterable[str] | None = None,
        eos_token: str | None = None,
        bos_token: str | None = None,
        add_bos: bool = False,
    ):
        self.specials = dict(specials) if specials is not None else default_specials()
        self.special_text = {i: s for s, i in self.specials.items()}
        names = DEFAULT_SKIPPED if skipped is None else skipped
        self.skipped = {self.specials[s] for s in names if s in self.specials}
        self.base = ordinary_base(self.specials.values(), LAYOUT.size)
        eos = eos_token if eos_token in self.specials else DEFAULT_EOS
        self.eos_id: int | None = self.specials.get(eos) if eos else None
        self.bos_token = bos_token if bos_token in self.specials else None
        self.add_bos = add_bos and self.bos_token is not None
        longest_first = sorted(self.specials, key=len, reverse=True)
        self._split = (
            re.compile("(" + "|".join(re.escape(s) for s in longest_first) + ")")
            if self.specials
            else None
        )
        self._index = {ch: i for i, ch in enumerate(ALPHABET)}
        self._word_ids = {w.decode(): self.base + 256 + i for i, w in enumerate(LAYOUT.words)}
        self._word_lengths = sorted({len(w) for w in self._word_ids}, reverse=True)
        self._word_starts = {w[0] for w in self._word_ids}
        self._pieces: dict[int, str] = {}

    @classmethod
    def from_checkpoint(cls, model_path: str) -> SimTokenizer:
        """The special tokens (and EOS, BOS) of a local checkpoint's tokenizer_config.json;
        Qwen3's defaults when there is none to read."""
        config = read_tokenizer_config(model_path)
        added = config.get("added_tokens_decoder")
        specials: dict[str, int] | None = None
        skipped: list[str] | None = None
        if isinstance(added, dict) and added:
            specials, skipped = {}, []
            for key, entry in added.items():
                content = entry.get("content") if isinstance(entry, dict) else None
                if isinstance(content, str) and str(key).isdigit():
                    specials[content] = int(key)
                    if entry.get("special") is True:
                        skipped.append(content)
        return cls(
            specials or None,
            skipped=skipped if specials else None,
            eos_token=token_text(config.get("eos_token")),
            bos_token=token_text(config.get("bos_token")),
            add_bos=config.get("add_bos_token") is True,
        )

    def id_of(self, special: str) -> int | None:
        """The id of a special token, None when this vocabulary has no such token."""
        return self.specials.get(special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the BOS first, where the checkpoint
        asks for one (`add_bos_token`), as `tokenizer.encode` does."""
        ids: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            ids.append(self.specials[self.bos_token])
        parts = self._split.split(text) if self._split is not None else [text]
        for n, part in enumerate(parts):
            if n % 2:
                ids.append(self.specials[part])
            elif part:
                self._encode_plain(part, ids)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; ids outside the vocabulary decode to nothing, and byte ids that
        do not form UTF-8 to U+FFFD, as a real tokenizer's decode does. `skip_special_tokens`
        drops the tokens the checkpoint marks `special` (`<|im_end|>`, not `<think>`)."""
        out: list[str] = []
        raw = bytearray()
        for token in ids:
            special = self.special_text.get(token)
            if special is not None:
                if raw:
                    out.append(_utf8(raw))
                    raw.clear()
                if not (skip_special_tokens and token in self.skipped):
                    out.append(special)
            else:
                raw += self._bytes(token)
        if raw:
            out.append(_utf8(raw))
        return "".join(out)

    def piece(self, token: int) -> str:
        """One id's text (what the detokenizer adds for it)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.decode([token])
        return text

    def word_id(self, word: str) -> int:
        """The id of a word of the word table (the filler units, `\\n\\n`, …)."""
        return self._word_ids[word]

    def _encode_plain(self, text: str, ids: list[int]) -> None:
        base, index, words = self.base, self._index, self._word_ids
        pairs_at, triples_at = base + LAYOUT.pairs_at, base + LAYOUT.triples_at
        width = len(ALPHABET)
        i, n = 0, len(text)
        while i < n:
            if text[i] in self._word_starts:
                for length in self._word_lengths:
                    word = words.get(text[i : i + length])
                    if word is not None:
                        ids.append(word)
                        i += length
                        break
                else:
                    word = None
                if word is not None:
                    continue
            a = index.get(text[i])
            b = index.get(text[i + 1]) if i + 1 < n else None
            if a is not None and b is not None:
                c = index.get(text[i + 2]) if i + 2 < n else None
                if c is not None:
                    ids.append(triples_at + (a * width + b) * width + c)
                    i += 3
                else:
                    ids.append(pairs_at + a * width + b)
                    i += 2
                continue
            ids.extend(base + byte for byte in text[i].encode("utf-8", "surrogatepass"))
            i += 1

    def _bytes(self, token: int) -> bytes:
        offset = token - self.base
        if offset < 0 or offset >= LAYOUT.size:
            return b""
        if offset < 256:
            return bytes((offset,))
        if offset < LAYOUT.pairs_at:
            return LAYOUT.words[offset - 256]
        width = len(ALPHABET)
        if offset < LAYOUT.triples_at:
            a, b = divmod(offset - LAYOUT.pairs_at, width)
            return (ALPHABET[a] + ALPHABET[b]).encode()
        ab, c = divmod(offset - LAYOUT.triples_at, width)
        a, b = divmod(ab, width)
        return (ALPHABET[a] + ALPHABET[b] + ALPHABET[c]).encode()


def _utf8(raw: bytearray) -> str:
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace")


def default_specials() -> dict[str, int]:
    """Qwen3's five special tokens with their real ids, then DeepSeek's role markers."""
    specials = dict(QWEN3_SPECIALS)
    after = max(specials.values()) + 1
    for i, token in enumerate(EMULATOR_SPECIALS):
        specials[token] = after + i
    return specials


def ordinary_base(special_ids: Iterable[int], size: int) -> int:
    """The lowest id from which `size` consecutive ids hold no special id."""
    base = 0
    for special in sorted(set(special_ids)):
        if special >= base + size:
            break
        if special >= base:
            base = special + 1
    return base


def token_text(value: Any) -> str | None:
    """A tokenizer_config token entry as text: a string, or an AddedToken's `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_tokenizer_config(model_path: str) -> dict[str, Any]:
    """tokenizer_config.json of a local checkpoint directory, or {} when there is none."""
    try:
        data = json.loads((Path(model_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
