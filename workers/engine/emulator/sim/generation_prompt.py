"""Where a prompt ends in a list of ids: the last assistant generation prompt of the template.

`/generate` gets ids: a rendered prompt, or a rendered prompt followed by output the model
already drew (a continuation). The emulator splits them at the end of the LAST generation
prompt, which it learns from its own chat template: it renders a probe conversation with
and without `add_generation_prompt`, once with thinking on and once off
(`enable_thinking`/`thinking` true, then false), and keeps what the generation prompt adds,
from its first special token on. For Qwen3 that is `<|im_start|>assistant\\n` (thinking on)
and the same plus `<think>\\n\\n</think>\\n\\n` (off); for Qwen3.5/3.6 `…assistant\\n<think>\\n`
(on); for DeepSeek-V3.1 `<｜Assistant｜><think>` (on) and `<｜Assistant｜></think>` (off).

What the model writes first follows from that suffix:
- `reasoning`: it opened `<think>` (Qwen3.5, DeepSeek thinking): the output starts reasoning;
- `think_first`: a header alone where the template closes an empty think block when thinking
  is off (Qwen3 thinking on): the model opens with the `<think>` id itself;
- `content`: a closed think block, or a template that ignores thinking: content only.

Output ids never hold a special id and every suffix starts with one, so the last match is
always the prompt's own generation prompt, however much output follows it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from genfleet.workers.engine.emulator.routes.error_bodies import ApiError
from genfleet.workers.engine.emulator.sim.chat_template import ChatTemplate
from genfleet.workers.engine.emulator.sim.tokenizer import THINK_END, THINK_START, SimTokenizer

log = logging.getLogger("genfleet.workers.engine.emulator")

Start = Literal["reasoning", "think_first", "content"]
PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
THINKING_KWARGS = {True: {"enable_thinking": True, "thinking": True},
                   False: {"enable_thinking": False, "thinking": False}}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GenerationPrompt:
    """One generation prompt's ids (from its first special id) and how output after it starts."""

    ids: tuple[int, ...]
    start: Start


@dataclass(frozen=True, slots=True)
class Split:
    """A request's ids cut in two: the prompt (`prompt_len` ids) and the output already drawn."""

    prompt_len: int
    drawn: int
    start: Start


@dataclass(frozen=True, slots=True)
class Family:
    """What the emulator knows of its template's turns: the generation prompts to look for and
    the text the model writes after `</think>` (`\\n\\n` for Qwen, nothing for DeepSeek)."""

    prompts: tuple[GenerationPrompt, ...]
    after_think: str

    def split(self, ids: list[int]) -> Split:
        """Cut `ids` after the last generation prompt; no prompt found: all of it is prompt."""
        best: tuple[int, int, Start] | None = None  # (end, start position, start)
        for prompt in self.prompts:
            at = rfind(ids, prompt.ids)
            if at is None:
                continue
            candidate = (at + len(prompt.ids), at, prompt.start)
            if best is None or (at, candidate[0]) > (best[1], best[0]):
                best = candidate
        if best is None:
            return Split(len(ids), 0, "content")
        end, _, start = best
        return Split(end, len(ids) - end, start)


def rfind(ids: list[int], pattern: tuple[int, ...]) -> int | None:
    """The last index at which `pattern` occurs in `ids`."""
    size = len(pattern)
    if not size or size > len(ids):
        return None
    first = pattern[0]
    for at in range(len(ids) - size, -1, -1):
        if ids[at] == first and tuple(ids[at : at + size]) == pattern:
            return at
    return None


def derive(template: ChatTemplate, tokenizer: SimTokenizer) -> Family:
    """The generation prompts of `template`, tokenized (see the module docstring)."""
    suffixes: dict[bool, str] = {}
    for thinking, kwargs in THINKING_KWARGS.items():
        try:
            messages = template.prepare_messages([dict(m) for m in PROBE])
            full = template.render(messages, kwargs, add_generation_prompt=True)
            bare = template.render(messages, kwargs, add_generation_prompt=False)
        except ApiError as exc:
            log.warning("Chat template %s does not render a probe chat: %s", template.origin, exc)
            continue
        if not full.startswith(bare):
            log.warning("Chat template %s: no generation prompt found", template.origin)
            continue
        suffix = from_first_special(full[len(bare) :], tokenizer)
        if suffix:
            suffixes[thinking] = suffix
    on, off = suffixes.get(True), suffixes.get(False)
    prompts: list[GenerationPrompt] = []
    for text in dict.fromkeys(s for s in (on, off) if s):
        start = classify(text, on, off, tokenizer)
        prompts.append(GenerationPrompt(tuple(tokenizer.encode(text)), start))
    after = ""
    if off is not None and THINK_END in off:
        after = off.rsplit(THINK_END, 1)[1]
    if after and len(tokenizer.encode(after)) != 1:
        after = ""
    return Family(tuple(prompts), after)


def from_first_special(text: str, tokenizer: SimTokenizer) -> str:
    """`text` from its first special token on ("" when it has none)."""
    found = [at for s in tokenizer.specials if (at := text.find(s)) >= 0]
    return text[min(found) :] if found else ""


def classify(text: str, on: str | None, off: str | None, tokenizer: SimTokenizer) -> Start:
    """How output after the generation prompt `text` starts (see the module docstring)."""
    if tokenizer.id_of(THINK_START) is None or tokenizer.id_of(THINK_END) is None or on == off:
        return "content"
    opened = text.rfind(THINK_START)
    if opened >= 0 and text.find(THINK_END, opened) < 0:
        return "reasoning"
    if THINK_END in text:
        return "content"
    return "think_first" if text == on else "content"
