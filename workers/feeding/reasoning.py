"""Reasoning and content apart, from an answer's raw text as `/generate` streams it.

SGLang's chat endpoint does this with its reasoning parser (`parser/reasoning_parser.py`,
`BaseReasoningFormatDetector.parse_streaming_increment`); an answer drawn by token ids comes
back as one text, `<think>` … `</think>` included, and the worker splits it the same way:
- an answer of a model with a reasoning parser, thinking on, is in its reasoning from its
  first token (the parser's `force_reasoning`): a Qwen3.5/3.6 or DeepSeek-V3.1 template opens
  `<think>` in the prompt, a Qwen3 one leaves the model to write it, and a leading `<think>`
  is dropped;
- the reasoning ends at the first `</think>`; what follows is the content, its leading line
  breaks dropped (the template's own separator, not the answer's);
- with thinking off, or no parser, everything is content.
A marker split across two chunks is held back until the next one shows what it is.
"""

from __future__ import annotations

from collections.abc import Sequence

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningSplit:
    """Feeds raw text pieces, returns the (reasoning, content) each adds; pure and
    restartable: `feed` of the same pieces in any cut gives the same halves in total."""

    __slots__ = ("in_reasoning", "started", "held", "content_begun")

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self.started = False  # the first piece of text arrived (a leading <think> is judged)
        self.held = ""  # the tail that may be the start of a marker
        self.content_begun = False  # content other than leading line breaks was given

    def restore(self, *, in_reasoning: bool, started: bool, held: str, content_begun: bool) -> None:
        """Back to a state `to_json` of a checkpointed answer kept."""
        self.in_reasoning, self.started = in_reasoning, started
        self.held, self.content_begun = held, content_begun

    def feed(self, piece: str) -> tuple[str, str]:
        """The reasoning and the content `piece` adds (either may be empty)."""
        text = self.held + piece
        self.held = ""
        reasoning = content = ""
        if not self.started:
            if THINK_START.startswith(text) and text != THINK_START:
                self.held = text  # maybe the start of a leading <think>
                return "", ""
            self.started = True
            if text.startswith(THINK_START):
                text = text[len(THINK_START) :]
                self.in_reasoning = True
        if self.in_reasoning:
            at = text.find(THINK_END)
            if at < 0:
                keep = _marker_prefix(text, THINK_END)
                if keep:
                    text, self.held = text[:-keep], text[-keep:]
                return text, ""
            reasoning, text = text[:at], text[at + len(THINK_END) :]
            self.in_reasoning = False
        if not self.content_begun:
            text = text.lstrip("\n")
            self.content_begun = bool(text)
        content = text
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back at the answer's end: text after all, not a marker."""
        held, self.held = self.held, ""
        if not held:
            return "", ""
        self.started = True
        if self.in_reasoning:
            return held, ""
        if not self.content_begun:
            held = held.lstrip("\n")
            self.content_begun = bool(held)
        return "", held


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def reasoning_token_count(
    output_ids: Sequence[int], think_end_id: int | None, thinking: bool
) -> int:
    """The answer's reasoning tokens: up to and including the `</think>` id, or all of them
    while the reasoning never ended (SGLang's `reasoning_tokens` counts the same way)."""
    if not thinking or think_end_id is None:
        return 0
    try:
        return output_ids.index(think_end_id) + 1
    except ValueError:
        return len(output_ids)
