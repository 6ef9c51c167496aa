"""Which characters of a rendered conversation are trained: each trained turn as the chat
template itself renders it, nothing searched for.

A turn's text is what rendering the conversation through that turn adds to rendering it up
to the turn (for an assistant turn, with the generation prompt: the text the model writes
after it). That text holds the template's end-of-turn marker (so the model learns to stop) and,
for an assistant turn, its reasoning and tool calls as the template writes them.

Templates do not all render a turn the same way wherever it sits. Qwen3's drops an assistant
turn's reasoning once a later user message follows; others rewrite earlier turns in other
ways. A trained turn whose rendering as the last turn is not where the whole conversation's
rendering starts is therefore trained in a sequence of its own: the conversation through that
turn, only that turn trained. Every turn is trained once, with exactly the text the model
produces at that point, instead of silently losing its reasoning (the failure trackers of
other tools report) or training text the model never writes.

The knobs (data keys): `roles_to_train` (which roles' turns; tool results never),
`last_turn_only`, `train_on_eos` (the end-of-turn marker, found by rendering a probe turn),
`train_on_reasoning` (the reasoning's characters, found as the difference between the turn
rendered with and without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from finetune.errors import PipelineError

#: a probe turn's text, to find what a template writes after an assistant turn's content
_PROBE = "\u2063probe\u2063"


def render(tok, template: str, messages: list[dict], generation_prompt: bool = False,
           tools: list[dict] | None = None) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=generation_prompt, tools=tools or None)


@dataclass
class Sequence:
    """One training sequence: its text, the character ranges trained, and ranges inside
    them that are not (an end-of-turn marker, reasoning)."""

    text: str
    trained: list[tuple[int, int]] = field(default_factory=list)
    excluded: list[tuple[int, int]] = field(default_factory=list)

    def char_mask(self) -> np.ndarray:
        mask = np.zeros(len(self.text), dtype=bool)
        for start, end in self.trained:
            mask[start:end] = True
        for start, end in self.excluded:
            mask[start:end] = False
        return mask


@dataclass(frozen=True)
class MaskRules:
    """What trains. `roles` None: every token but tool results (assistant_only_loss false)."""

    roles: tuple[str, ...] | None = ("assistant",)
    last_only: bool = False
    eos: bool = True
    reasoning: bool = True


class Renderer:
    """A template bound to a tokenizer and one row's tools."""

    def __init__(self, tok, template: str, tools: list[dict] | None, where: str):
        self.tok, self.template, self.tools, self.where = tok, template, tools, where

    def __call__(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if not messages:  # some templates read messages[0]: the empty conversation is ""
            try:
                return render(self.tok, self.template, [], generation_prompt, self.tools)
            except Exception:
                return ""
        try:
            return render(self.tok, self.template, messages, generation_prompt, self.tools)
        except Exception as exc:  # the template's own refusal (raise_exception), as one line
            message = " ".join(str(exc).split())
            raise PipelineError(
                f"data.chat_template cannot render {self.where} through turn "
                f"{len(messages) - 1} ({type(exc).__name__}: {message}); the mask renders the "
                "conversation up to each trained turn: train fewer roles (roles_to_train) or "
                "use a template that renders such a prefix") from None

    def turn(self, conv: list[dict], t: int) -> tuple[str, int]:
        """The rendering through turn t and where turn t's text starts in it."""
        before = self(conv[:t], generation_prompt=conv[t]["role"] == "assistant")
        through = self(conv[:t + 1])
        if not through.startswith(before):
            raise PipelineError(
                f"data.chat_template cannot mark turns in {self.where} (turn {t}): rendering "
                "the conversation through the turn does not start with rendering it up to the "
                "turn; use a template that renders earlier turns the same way")
        return through, len(before)


def end_of_turn(tok, template: str) -> str | None:
    """The template's end-of-turn marker: what it writes after an assistant turn's content
    (trailing whitespace aside), from rendering a probe turn; None when it writes none (or
    the probe does not render), then the tokenizer's EOS token where it has one."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render(tok, template, probe)
        at = text.rfind(_PROBE)
        marker = text[at + len(_PROBE):].strip() if at >= 0 else ""
    except Exception:
        marker = ""
    return marker or getattr(tok, "eos_token", None) or None


def sequences(tok, template: str, conv: list[dict], tools: list[dict] | None,
              rules: MaskRules, where: str, marker: str | None = None) -> list[Sequence]:
    """The training sequences of one conversation (the whole conversation first; a turn the
    whole rendering shows otherwise gets its own, module docstring), with their masks."""
    render_ = Renderer(tok, template, tools, where)
    full = Sequence(render_(conv))
    if rules.roles is None:
        full.trained.append((0, len(full.text)))
        full.excluded.extend(_tool_results(render_, conv, full.text))
        return [full]
    turns = [t for t, m in enumerate(conv) if m["role"] in rules.roles]
    if rules.last_only:
        turns = [t for t in turns if conv[t]["role"] == "assistant"][-1:]
    own: list[Sequence] = []
    for t in turns:
        through, start = render_.turn(conv, t)
        seq = full if full.text.startswith(through) else Sequence(through)
        if seq is not full:
            own.append(seq)
        seq.trained.append((start, len(through)))
        if not rules.eos and marker:
            at = through.rfind(marker, start)
            if at >= 0:
                seq.excluded.append((at, len(through)))
        if conv[t].get("reasoning_content"):
            reasoning = _reasoning_span(render_, conv, t, through)
            if reasoning is None and rules.reasoning:
                raise PipelineError(
                    f"data.chat_template does not render reasoning_content ({where}, turn "
                    f"{t}): the reasoning would be dropped; use a template that renders it, "
                    "or set data.train_on_reasoning: false to train the turn without it")
            if reasoning is not None and not rules.reasoning:
                seq.excluded.append(reasoning)
    return ([full] if full.trained else []) + own


def _reasoning_span(render_: Renderer, conv: list[dict], t: int, through: str
                    ) -> tuple[int, int] | None:
    """Where turn t's reasoning sits in `through` (its rendering as the last turn): the
    characters that differ from rendering the turn without it. None: the template does not
    render it."""
    bare = {k: v for k, v in conv[t].items() if k != "reasoning_content"}
    without = render_(conv[:t] + [bare])
    if without == through:
        return None
    head = 0
    limit = min(len(through), len(without))
    while head < limit and through[head] == without[head]:
        head += 1
    tail = 0
    while tail < limit - head and through[-1 - tail] == without[-1 - tail]:
        tail += 1
    return head, len(through) - tail


def _tool_results(render_: Renderer, conv: list[dict], full: str) -> list[tuple[int, int]]:
    """The characters of each run of tool results (rendered as one block: several templates
    put consecutive results in one turn), where the whole rendering shows them as such."""
    spans, t = [], 0
    while t < len(conv):
        if conv[t]["role"] != "tool":
            t += 1
            continue
        end = t
        while end < len(conv) and conv[end]["role"] == "tool":
            end += 1
        before, through = render_(conv[:t]), render_(conv[:end])
        if through.startswith(before) and full.startswith(through):
            spans.append((len(before), len(through)))
        t = end
    return spans


def token_mask(offsets: list[tuple[int, int]], chars: np.ndarray) -> np.ndarray:
    """Which tokens are trained: those overlapping a trained character (a word piece may
    carry the space before a turn's first word, "Assistant: It" -> "▁It")."""
    if not len(offsets):
        return np.zeros(0, dtype=bool)
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    cum = np.concatenate([[0], np.cumsum(chars, dtype=np.int64)])
    spans = np.clip(spans, 0, len(chars))
    return (cum[spans[:, 1]] - cum[spans[:, 0]]) > 0
