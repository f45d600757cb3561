"""vLLM's repetition detection rule, re-implemented from its description, for comparison.

vLLM (`SamplingParams.repetition_detection`, `RepetitionDetectionParams`, stop reason
`repetition_detected`, finish reason `repetition`) is off by default; a request sets
`max_pattern_size`, `min_pattern_size` and `min_count`. After each generated token the
scheduler's stop check asks, for every pattern size L from `min_pattern_size` to
`max_pattern_size`, whether the last L tokens are the last of `min_count` identical,
back-to-back copies of an L-token pattern; the first size that is ends the request. There is
no look at the prompt and no span in characters: a pattern of one token repeated
`min_count` times is enough.

This stand-in works on text: a rough tokenizer (a word with its leading space, one to three
digits, one other character, a run of whitespace) stands in for the model's, and the check
runs at the end of each streamed chunk (a pattern that ends the text mid-chunk still ends it
at the chunk's end, rotated). Only its decisions are compared, not its speed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN = re.compile(r" ?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]|\s+")


@dataclass(frozen=True, slots=True)
class VllmProfile:
    """One choice of vLLM's three parameters."""

    min_pattern_size: int
    max_pattern_size: int
    min_count: int

    @property
    def name(self) -> str:
        return (
            f"vLLM rule, patterns {self.min_pattern_size}-{self.max_pattern_size} tokens "
            f"x {self.min_count}"
        )


class VllmRepetition:
    """One stream's check under one profile; `feed` → True once the rule stops it."""

    def __init__(self, profile: VllmProfile) -> None:
        self.profile = profile
        self.tokens: list[str] = []
        self._carry = ""  # the last token of the text so far, perhaps unfinished

    def feed(self, delta: str) -> bool | None:
        tokens = TOKEN.findall(self._carry + delta)
        self._carry = tokens.pop() if tokens else ""
        self.tokens += tokens
        keep = self.profile.max_pattern_size * self.profile.min_count
        if len(self.tokens) > 4 * keep:
            del self.tokens[:-keep]
        return True if self.repeating() else None

    def repeating(self) -> bool:
        tokens, p = self.tokens, self.profile
        n = len(tokens)
        for size in range(p.min_pattern_size, p.max_pattern_size + 1):
            if size * p.min_count > n:
                return False
            pattern = tokens[n - size :]
            if all(
                tokens[n - size * (k + 1) : n - size * k] == pattern for k in range(1, p.min_count)
            ):
                return True
        return False


PROFILES = (
    VllmProfile(1, 64, 8),
    VllmProfile(1, 1024, 4),
    VllmProfile(16, 1024, 4),  # llama.cpp's port of the rule: its default profile
)
