"""Reward functions: a config list of references (`grpo.reward_funcs`) as callables, for any
method that scores completions (engine.rollout.scoring scores a batch with them).

The caller names the config key (`key="grpo.reward_funcs"`), so every message names the entry
as the params file does while this module names no method. A reference is a built-in's name
(`BUILT_INS`), or user code as `package.module:function` or `path/to/file.py:function`
(finetune.imports.load_object). Every function is called as TRL
1.16's GRPOTrainer calls a plain reward function (`_calculate_rewards`), so a reward function
written for TRL runs unchanged: keyword arguments `prompts`, `completions`, `completion_ids`,
every other column of the rows as a list (not `prompt`, `completion`, `completion_ids`),
`trainer_state`, and the `log_extra(column, values)` / `log_metric(name, value)` callables
(no-ops unless the run passes its own). Completions are strings, or, for conversational
prompts, lists of messages (`[{"role": "assistant", "content": ...}]`). A function returns one
number per completion, or None where it does not apply (a NaN score); `async def` functions
are awaited together, as TRL does.

The built-ins (options in `RewardOptions`, which the run fills from the config):

- `correctness`: 1.0 when the completion's final answer equals the reference's, else 0.0
  (finetune.datatypes.metrics.is_exact_match with `answer_regex`: the evaluate stage's answer
  extraction, so `#### 1,000` equals `#### 1000`); None when the reference has no answer to
  compare with (TRL's accuracy_reward skips an unparseable gold answer the same way).
- `format`: 1.0 when `format_regex` is found in the completion (re.search), else 0.0.
- `length` (also under TRL's name, `soft_overlong_punishment`): DAPO's soft overlong
  punishment (TRL's get_soft_overlong_punishment): 0 up to `soft_length` completion tokens,
  then linearly down to -1.0 at `max_completion_length`, -1.0 beyond.

Built-ins read the text of a conversational completion's last assistant message.

An entry may also be a trained reward model (engine.rollout.reward_model): a directory
path, loaded once on `RewardOptions.device`; a registered model (`models:/...`) reaches the
engine already resolved to its downloaded directory (tasks.model_refs).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from finetune.config.reward_refs import reward_kind, reward_name
from finetune.datatypes.metrics import extract_answer, is_exact_match
from finetune.errors import PipelineError
from finetune.imports import load_object

#: the keyword arguments a reward function gets besides the rows' columns (TRL's names)
ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
             "log_metric")
#: row columns TRL does not pass on (the prompt is `prompts`; the completion is generated)
NOT_PASSED = ("prompt", "completion", "completion_ids")


@dataclass(frozen=True)
class RewardOptions:
    """What the built-ins read from the config."""

    #: the evaluate stage's eval.answer_regex: group 1 is a text's final answer
    answer_regex: str = r"####\s*(.+)"
    #: the row column holding the reference answer (`correctness`)
    reference_column: str = "answer"
    #: `format`: the GSM8K final-answer line, `####` then a number (`#### 1,000`, `#### -2.5`)
    format_regex: str = r"####\s*-?[\d,]*\.?\d+"
    #: `length`: where the penalty reaches -1.0 (the run's generation limit)
    max_completion_length: int = 256
    #: `length`: the completion length (tokens) past which the penalty starts; None: DAPO's
    #: proportions, a soft band of the last fifth (4096 of 20480 tokens in the paper), i.e.
    #: max_completion_length - max_completion_length // 5
    soft_length: int | None = None
    #: reward models: what a relative directory resolves against, the device they are
    #: loaded on, and how many completions one forward scores
    root: Path = Path(".")
    device: torch.device = torch.device("cpu")
    batch_size: int = 8


def reward_options(section, *, answer_regex: str, batch_size: int, root: Path = Path("."),
                   device: torch.device | None = None) -> RewardOptions:
    """What the built-ins read, from a config section with the `grpo` section's names
    (reference_column, format_regex, max_completion_length) and the evaluate stage's
    `answer_regex`; a reward model's directory resolves against `root`, loads on `device`
    (CPU when None) and scores `batch_size` completions per forward."""
    return RewardOptions(answer_regex=answer_regex,
                         reference_column=section.reference_column,
                         format_regex=section.format_regex,
                         max_completion_length=section.max_completion_length, root=Path(root),
                         device=device or torch.device("cpu"), batch_size=batch_size)


@dataclass(frozen=True)
class RewardFunction:
    name: str  # for metrics (rewards/<name>/mean): a built-in's name, or the function's name
    fn: Callable  # called as TRL calls a reward function (see the module docstring)


# -- completions as text ----------------------------------------------------------------------

def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or a conversational completion's last assistant
    message's content (its text parts joined, for content given as parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        message = completion
    elif isinstance(completion, (list, tuple)):
        replies = [m for m in completion
                   if isinstance(m, Mapping) and m.get("role", "assistant") == "assistant"]
        if not replies:
            raise TypeError(f"a conversational completion without an assistant message: "
                            f"{shown(completion)}")
        message = replies[-1]
    else:
        raise TypeError(f"a completion is a string or a list of messages, not "
                        f"{shown(completion)}")
    content = message.get("content")
    if content is None:  # a message that only calls a tool
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content
                   if isinstance(part, Mapping) and part.get("type", "text") == "text")


# -- built-ins --------------------------------------------------------------------------------

#: built-in name -> factory(options) -> reward function; a method may add its own
BUILT_INS: dict[str, Callable[[RewardOptions], Callable]] = {}


def built_in(*names: str):
    """Register a factory under `names` (a decorator)."""
    def register(factory):
        for name in names:
            BUILT_INS[name] = factory
        return factory
    return register


def _regex(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise PipelineError(f"{what} {pattern!r} is not a regular expression ({exc})") from None


@built_in("correctness")
def correctness_reward(options: RewardOptions) -> Callable:
    pattern, column = options.answer_regex, options.reference_column
    if _regex(pattern, "answer_regex").groups < 1:
        raise PipelineError(f"answer_regex {pattern!r} needs a group: group 1 is the answer")

    def correctness(completions, **kwargs) -> list[float | None]:
        if column not in kwargs:
            present = [k for k in kwargs if k not in ARGUMENTS and k != "environments"]
            raise PipelineError(
                f"the reference answers are read from column '{column}' (reference_column), "
                f"which the rows do not have (columns: {', '.join(present) or 'none'})")
        rewards: list[float | None] = []
        for completion, reference in zip(completions, kwargs[column], strict=True):
            reference = None if reference is None else _text(reference)
            if reference is None or extract_answer(reference, pattern) is None:
                rewards.append(None)  # nothing to compare with: not scored
            else:
                hit = is_exact_match(completion_text(completion), reference, pattern)
                rewards.append(1.0 if hit else 0.0)
        return rewards

    return correctness


@built_in("format")
def format_reward(options: RewardOptions) -> Callable:
    regex = _regex(options.format_regex, "format_regex")

    def matches_format(completions, **kwargs) -> list[float]:
        return [1.0 if regex.search(completion_text(c)) else 0.0 for c in completions]

    return matches_format


@built_in("length", "soft_overlong_punishment")
def length_reward(options: RewardOptions) -> Callable:
    longest = options.max_completion_length
    soft = longest - longest // 5 if options.soft_length is None else options.soft_length
    if not 0 <= soft <= longest:
        raise PipelineError(f"soft_length {soft} must be between 0 and max_completion_length "
                            f"{longest}")
    band = longest - soft  # TRL's soft_punish_cache

    def length(completion_ids, **kwargs) -> list[float]:
        # TRL's numbers: (soft - n) / band inside the band, 0 before it, -1 after it
        return [0.0 if n <= soft else (soft - n) / band if n <= longest else -1.0
                for n in map(len, completion_ids)]

    return length


def _text(value: Any) -> str:
    return value if isinstance(value, str) else (
        completion_text(value) if isinstance(value, (list, tuple, Mapping)) else str(value))


# -- loading ----------------------------------------------------------------------------------

def callable_name(fn: Callable) -> str:
    """TRL's name for a reward function (get_callable_name): a partial's function's name, else
    the function's __name__, else its class's name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def load_reward_functions(refs: list[str], options: RewardOptions, *, key: str
                          ) -> list[RewardFunction]:
    """The config's reward list as functions, in its order; `key`: the list's config key, which
    each message names with the entry's index (`grpo.reward_funcs[1]`). A name used twice is
    made unique (`name`, `name_2`, ...), in list order."""
    loaded: list[RewardFunction] = []
    taken: set[str] = set()
    for i, ref in enumerate(refs):
        entry = f"{key}[{i}]"
        if not isinstance(ref, str) or not ref.strip():
            raise PipelineError(f"{entry}: {ref!r} is not a reward function name or a "
                                "'package.module:function' reference")
        ref = ref.strip()
        kind = reward_kind(ref)
        if kind == "registered":
            raise PipelineError(f"{entry} '{ref}': a registered model is resolved to its files by "
                                "the train and evaluate stages (tasks.model_refs); in your own "
                                "script pass the model's directory")
        if kind == "directory":
            from engine.rollout.reward_model import RewardModel, check_reward_model

            directory = check_reward_model(options.root, ref, entry)
            fn = RewardModel(directory, reward_name(ref), options.device, options.batch_size)
            name = fn.__name__
        elif ":" in ref:
            fn = load_object(ref, entry)
            if isinstance(fn, torch.nn.Module):
                raise PipelineError(f"{entry} '{ref}': a model as a reward function is not "
                                    "supported as an object; name its saved directory (a "
                                    "path with a '/'), or a function that returns rewards")
            if not callable(fn):
                raise PipelineError(f"{entry} '{ref}': {type(fn).__name__} object is not "
                                    "callable; name a reward function")
            name = callable_name(fn)
        elif ref in BUILT_INS:
            try:
                fn = BUILT_INS[ref](options)
            except PipelineError as exc:
                raise PipelineError(f"{entry} '{ref}': {exc}") from None
            name = ref
        else:
            close = difflib.get_close_matches(ref, BUILT_INS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise PipelineError(
                f"{entry} '{ref}': no such built-in reward function{hint} (built-ins: "
                f"{', '.join(sorted(BUILT_INS))}; or name your own as 'package.module:function' "
                "or 'path/to/file.py:function', or a reward model's directory as a path with a "
                "'/')")
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}_{n}"
        taken.add(unique)
        loaded.append(RewardFunction(unique, fn))
    return loaded


def shown(value: Any, width: int = 60) -> str:
    """A value as a message shows it: its type and its (shortened) repr."""
    text = repr(value)
    text = text if len(text) <= width else text[:width - 3] + "..."
    return f"{type(value).__name__} {text}"
