"""GRPO's reward functions and advantages (engine/rollout/rewards.py, scoring.py,
engine/recipe/grpo/advantages.py) against TRL 1.16, the oracle: reward functions copied from
TRL's GRPOTrainer documentation and TRL's own built-ins run unchanged, scored as TRL's
`_calculate_rewards` scores them (called here on a stand-in trainer); the length penalty gives
TRL's soft overlong punishment's numbers; the advantages and logged statistics are those of
TRL's `sum_then_normalize` source lines, run here as written. Failures are one line naming
grpo.reward_funcs[i]."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import sys
import textwrap
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.recipe.grpo.advantages import group_advantages, nanstd
from engine.rollout import rewards as rollout_rewards
from engine.rollout import scoring
from engine.rollout.rewards import BUILT_INS, RewardFunction, RewardOptions
from finetune.errors import PipelineError

#: the config key GRPO passes the rollout (engine.recipe.grpo.heldout.rewards_key), which
#: every message below names
KEY = "grpo.reward_funcs"
load_reward_functions = functools.partial(rollout_rewards.load_reward_functions, key=KEY)
score = functools.partial(scoring.score, key=KEY)

NAN = math.nan

# Copied unchanged from TRL's docs (docs/source/grpo_trainer.md, "Using a custom reward
# function": examples 2, 3, 4 and 5). Example 4's helper is the user's, so it is written here.
TRL_DOC_REWARDS = r'''
import asyncio
import re


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def check_math_solution(prompt, completion):
    return completion.strip() == str(eval(prompt.removeprefix("What is ").rstrip("?")))


# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
'''
# TRL's docs, example 1, as printed: it names its argument `completions_ids`, but TRL passes
# `completion_ids`, so TRL's trainer fails on it too (test_a_doc_typo_fails_as_in_trl).
TRL_DOC_EXAMPLE_1 = r'''
def reward_func(completions_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completions_ids]
'''

GSM8K_REFERENCE = ("Each box holds 40 * 25 = <<40*25=1000>>1000 pens.\n"
                   "He has 1000 pens in all.\n#### 1,000")


def _chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _ids(*lengths: int) -> list[list[int]]:
    return [list(range(n)) for n in lengths]


def _score(funcs, completions, columns=None, prompts=None, ids=None, **kw) -> torch.Tensor:
    n = len(completions)
    return score(funcs, prompts or ["Q"] * n, completions, ids or _ids(*[3] * n),
                 columns or {}, **kw)


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# -- TRL as the oracle -----------------------------------------------------------------------

def _trl_calculate_rewards(funcs, prompts, completions, completion_ids, columns, state=None):
    """TRL's GRPOTrainer._calculate_rewards on a stand-in trainer holding only what it reads."""
    from trl import GRPOTrainer
    from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon(name="trl-oracle")
    ready.wait()
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=SimpleNamespace(report_to=[]), state=state or SimpleNamespace(global_step=0),
        reward_funcs=[f.fn for f in funcs], reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.name for f in funcs], environments=None, async_loop=loop,
        _log_completion_extra=lambda column, values: None,
        _log_metric=lambda name, value: None)
    inputs = [{"prompt": p, **{k: v[j] for k, v in columns.items()}}
              for j, p in enumerate(prompts)]
    try:
        return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions,
                                              completion_ids)
    finally:
        shutdown_event_loop_in_daemon(thread, loop)


@functools.cache
def _trl_advantage_lines():
    """TRL's sum_then_normalize lines (from the unscorable mask to the last logged reward
    metric) of GRPOTrainer._generate_and_score_completions, compiled as written."""
    from trl.trainer import grpo_trainer

    lines = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    lines = lines.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)" in line)
    end = next(i for i, line in enumerate(lines) if '["frac_reward_zero_std"].append' in line)
    assert 'self.multi_objective_aggregation == "sum_then_normalize"' in "\n".join(
        lines[start:end])
    return compile(textwrap.dedent("\n".join(lines[start:end + 1])), "trl-grpo", "exec")


def _trl_advantages(rewards_per_func, weights, num_generations, scale):
    from trl.trainer.utils import nanstd as trl_nanstd

    n, funcs = rewards_per_func.shape
    trainer = SimpleNamespace(
        multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
        reward_weights=weights, reward_func_names=[str(i) for i in range(funcs)],
        _metrics={"train": defaultdict(list)}, accelerator=SimpleNamespace(process_index=0))
    scope = {"self": trainer, "torch": torch, "nanstd": trl_nanstd, "mode": "train",
             "rewards_per_func": rewards_per_func.clone(), "num_generations": num_generations,
             "device": torch.device("cpu"), "prompts": [None] * n}
    exec(_trl_advantage_lines(), scope)
    return scope["all_process_advantages"], {k: v[-1] for k, v in trainer._metrics["train"].items()}


# -- built-ins ---------------------------------------------------------------------------------

def test_correctness_compares_final_answers_as_the_evaluate_stage_does():
    [fn] = load_reward_functions(["correctness"], RewardOptions())
    completions = ["40 * 25 = 1000\n#### 1000", "40 * 25 = 999\n#### 999",
                   "So he has 1000 pens.",  # no marker: the last number, as eval reads it
                   "#### $1,000.00", "I do not know"]
    references = [GSM8K_REFERENCE] * 5
    want = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0]])
    _assert_same(_score([fn], completions, {"answer": references}), want)
    chat = [_chat(c) for c in completions]
    _assert_same(_score([fn], chat, {"answer": references}), want)
    # a conversation: the last assistant message is the answer
    turns = [[{"role": "assistant", "content": "#### 7"}, {"role": "tool", "content": "1000"},
              {"role": "assistant", "content": "so #### 1000"}]]
    _assert_same(_score([fn], turns, {"answer": references[:1]}), torch.tensor([[1.0]]))


def test_correctness_reads_the_configured_column_and_skips_rows_without_a_reference():
    options = RewardOptions(reference_column="solution", answer_regex=r"answer:\s*(.+)")
    [fn] = load_reward_functions(["correctness"], options)
    got = _score([fn], ["answer: 12", "answer: 12", "answer: 12", "answer: 12"],
                 {"solution": ["answer: 12", "answer: 13", None, "no answer here"]})
    _assert_same(got, torch.tensor([[1.0], [0.0], [NAN], [NAN]]))


def test_correctness_names_a_missing_column_and_the_columns_present():
    funcs = load_reward_functions(["format", "correctness"], RewardOptions())
    with pytest.raises(PipelineError) as exc:
        _score(funcs, ["#### 1"], {"solution": ["#### 1"], "level": [3]})
    message = _one_line(exc)
    assert message.startswith("grpo.reward_funcs[1] 'correctness': ")
    assert "'answer'" in message and "columns: solution, level" in message


def test_format_searches_the_regex_in_strings_and_messages():
    [fn] = load_reward_functions(["format"], RewardOptions())
    completions = ["so\n#### 1,000", "####72", "#### -2.5 apples", "#### none", "answer: 5",
                   "1000"]
    want = torch.tensor([[1.0], [1.0], [1.0], [0.0], [0.0], [0.0]])
    _assert_same(_score([fn], completions), want)
    _assert_same(_score([fn], [_chat(c) for c in completions]), want)
    parts = [[{"role": "assistant", "content": [{"type": "text", "text": "#### 4"}]}]]
    _assert_same(_score([fn], parts), torch.tensor([[1.0]]))
    [own] = load_reward_functions(["format"], RewardOptions(format_regex=r"^<think>"))
    _assert_same(_score([own], ["<think>x", "x<think>"]), torch.tensor([[1.0], [0.0]]))


@pytest.mark.parametrize("longest,soft", [(100, 80), (16, 12), (10, 10), (8, 0), (7, 3)])
def test_length_is_trls_soft_overlong_punishment(longest, soft):
    from trl.rewards import get_soft_overlong_punishment

    lengths = list(range(longest + 4))
    trl = get_soft_overlong_punishment(max_completion_len=longest,
                                       soft_punish_cache=longest - soft)
    want = torch.tensor(trl(_ids(*lengths)), dtype=torch.float32).unsqueeze(1)
    for name in ("length", "soft_overlong_punishment"):
        [fn] = load_reward_functions(
            [name], RewardOptions(max_completion_length=longest, soft_length=soft))
        _assert_same(_score([fn], ["x"] * len(lengths), ids=_ids(*lengths)), want)
    assert want.min() == -1.0 and want[soft, 0] == 0.0


def test_length_defaults_to_dapos_soft_band_and_matches_trls_docstring():
    # TRL's docstring: max 100, cache 20, a 90-token completion -> -0.5
    [fn] = load_reward_functions(["length"], RewardOptions(max_completion_length=100))
    got = _score([fn], ["x"] * 5, ids=_ids(0, 80, 90, 100, 101))
    _assert_same(got, torch.tensor([[0.0], [0.0], [-0.5], [-1.0], [-1.0]]))


@pytest.mark.parametrize("options,words", [
    (RewardOptions(soft_length=300), "soft_length 300 must be between 0 and"),
    (RewardOptions(soft_length=-1), "soft_length -1"),
])
def test_a_bad_length_option_is_one_line(options, words):
    with pytest.raises(PipelineError) as exc:
        load_reward_functions(["format", "length"], options)
    assert _one_line(exc).startswith(f"grpo.reward_funcs[1] 'length': {words}")


@pytest.mark.parametrize("ref,options,words", [
    ("format", RewardOptions(format_regex="####(("), "format_regex '####((' is not a regular"),
    ("correctness", RewardOptions(answer_regex="[0-9"), "answer_regex '[0-9' is not a regular"),
    ("correctness", RewardOptions(answer_regex="####"), "needs a group"),
])
def test_a_bad_regex_is_one_line_at_load(ref, options, words):
    with pytest.raises(PipelineError) as exc:
        load_reward_functions([ref], options)
    message = _one_line(exc)
    assert message.startswith(f"grpo.reward_funcs[0] '{ref}': ") and words in message


# -- user functions: TRL's documentation, TRL's built-ins ---------------------------------------

def test_trls_documented_reward_functions_run_unchanged_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    _write(tmp_path / "rewards", "doc_rewards.py", TRL_DOC_REWARDS)
    monkeypatch.chdir(tmp_path)  # relative references resolve against the working directory
    funcs = load_reward_functions(
        ["rewards/doc_rewards.py:reward_func", "rewards/doc_rewards:math_reward_func",
         f"{tmp_path}/rewards/doc_rewards.py:async_reward_func"], RewardOptions())
    assert [f.name for f in funcs] == ["reward_func", "math_reward_func", "async_reward_func"]
    # the docs' examples 3, 4 and 5, with their inputs and outputs
    prompts = ["What is 1+1?", "Write a function.", "What is 3*4?", "What is 10-4?"]
    completions = [r" The solution is \boxed{2}.", "", "12", r" The solution is \boxed{6}."]
    columns = {"ground_truth": ["2", "2", "12", "5"], "task": ["math", "code", "math", "math"]}
    got = score(funcs, prompts, completions, _ids(1, 2, 3, 4), columns)
    want = torch.tensor([[1.0, -1.0, 1.0], [0.0, NAN, 0.0], [0.0, 1.0, 1.0], [0.0, -1.0, 1.0]])
    _assert_same(got, want)
    _assert_same(got, _trl_calculate_rewards(funcs, prompts, completions, _ids(1, 2, 3, 4),
                                             columns))


def test_trls_documented_conversational_reward_runs_unchanged(tmp_path):
    path = _write(tmp_path, "doc_rewards.py", TRL_DOC_REWARDS)
    funcs = load_reward_functions([f"{path}:format_reward_func", "format"], RewardOptions())
    # the docs' example 2, with its inputs and outputs
    prompts = [[{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}],
               [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}]]
    completions = [
        _chat("<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
              "<answer>(1 + 2) * 4 = 12</answer>"),
        _chat("The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.")]
    got = score(funcs, prompts, completions, _ids(5, 6), {})
    _assert_same(got, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    _assert_same(got, _trl_calculate_rewards(funcs, prompts, completions, _ids(5, 6), {}))


def test_a_trl_builtin_runs_by_reference():
    funcs = load_reward_functions(["trl.rewards:think_format_reward", "correctness"],
                                  RewardOptions())
    assert [f.name for f in funcs] == ["think_format_reward", "correctness"]
    completions = [_chat("<think>\n40 * 25 = 1000\n</think>\n#### 1000"),
                   _chat("<think>\n40 * 25 = 999\n#### 999")]
    columns = {"answer": [GSM8K_REFERENCE] * 2}
    got = _score(funcs, completions, columns)
    _assert_same(got, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    _assert_same(got, _trl_calculate_rewards(funcs, ["Q", "Q"], completions, _ids(3, 3),
                                             columns))


def test_a_function_is_called_with_what_trl_passes_it():
    seen = []

    def spy(**kwargs):
        seen.append({k: v for k, v in kwargs.items() if k not in ("log_extra", "log_metric")})
        assert callable(kwargs["log_extra"]) and callable(kwargs["log_metric"])
        return [0.5] * len(kwargs["completions"])

    funcs = [RewardFunction("spy", spy)]
    state = SimpleNamespace(global_step=7)
    args = (["p0", "p1"], ["c0", "c1"], _ids(1, 2),
            {"answer": ["a0", "a1"], "level": [1, 2], "completion": ["x", "y"]})
    _trl_calculate_rewards(funcs, *args, state=state)
    score(funcs, *args, trainer_state=state)
    trl, ours = seen
    assert set(ours) == set(trl) == {"prompts", "completions", "completion_ids",
                                     "trainer_state", "answer", "level"}
    assert ours == trl and ours["trainer_state"] is state


def test_log_extra_and_log_metric_are_no_ops_unless_given():
    def logs(completions, log_extra, log_metric, **kwargs):
        log_extra("golden", ["g"] * len(completions))
        log_metric("share", 0.25)
        return [1.0] * len(completions)

    funcs = [RewardFunction("logs", logs)]
    _assert_same(_score(funcs, ["a", "b"]), torch.tensor([[1.0], [1.0]]))
    extra, metrics = [], []
    _score(funcs, ["a", "b"], log_extra=lambda c, v: extra.append((c, v)),
           log_metric=lambda n, v: metrics.append((n, v)))
    assert extra == [("golden", ["g", "g"])] and metrics == [("share", 0.25)]


def test_async_functions_are_awaited_together_even_inside_a_running_loop():
    async def slow(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [float(len(c)) for c in completions]

    async def late(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [None, 2.0]

    class Caller:  # a callable class with an async __call__, as TRL's is_async_callable knows
        async def __call__(self, completions, **kwargs):
            return [3.0] * len(completions)

    funcs = [RewardFunction("slow", slow), RewardFunction("sync", lambda **kw: [1.0, 1.0]),
             RewardFunction("late", late), RewardFunction("caller", Caller())]
    want = torch.tensor([[1.0, 1.0, NAN, 3.0], [2.0, 1.0, 2.0, 3.0]])
    started = time.monotonic()
    _assert_same(_score(funcs, ["a", "bb"]), want)
    assert time.monotonic() - started < 0.39  # together: one after the other takes 0.4 s

    async def from_a_loop():
        return _score(funcs, ["a", "bb"])

    _assert_same(asyncio.run(from_a_loop()), want)
    _assert_same(want, _trl_calculate_rewards(funcs, ["Q", "Q"], ["a", "bb"], _ids(3, 3), {}))


def test_none_is_nan_and_a_row_no_function_scored_is_named(capsys):
    funcs = [RewardFunction("half", lambda completions, **kw: [1.0, None, None]),
             RewardFunction("other", lambda completions, **kw: [None, 0.5, None])]
    got = _score(funcs, ["a", "b", "c"])
    _assert_same(got, torch.tensor([[1.0, NAN], [NAN, 0.5], [NAN, NAN]]))
    err = capsys.readouterr().err
    assert err.startswith("warning: grpo: every reward function returned None for 1 of 3 "
                          "completions (first: completion 2)")
    _score(funcs[:1], ["a", "b", "c"])
    assert "for 2 of 3" in capsys.readouterr().err


def test_numbers_of_any_kind_are_rewards():
    funcs = [RewardFunction("np", lambda **kw: np.array([1, 0])),
             RewardFunction("torch", lambda **kw: torch.tensor([0.25, 0.75])),
             RewardFunction("scalars", lambda **kw: (np.float64(2.5), torch.tensor(-1.0))),
             RewardFunction("bools", lambda **kw: [True, np.bool_(False)])]
    _assert_same(_score(funcs, ["a", "b"]),
                 torch.tensor([[1.0, 0.25, 2.5, 1.0], [0.0, 0.75, -1.0, 0.0]]))


# -- one-line failures -------------------------------------------------------------------------

def _boom(completions, **kwargs):
    return [1 / 0 for _ in completions]


@pytest.mark.parametrize("fn,words", [
    (_boom, "'_boom' failed on 3 completions: ZeroDivisionError: division by zero"),
    (lambda **kw: [1.0, 2.0], "'<lambda>' returned 2 rewards for 3 completions"),
    (lambda **kw: [1.0, "good", 0.0], "'<lambda>' returned str 'good' for completion 1: a "
                                      "reward is a number"),
    (lambda **kw: None, "'<lambda>' returned NoneType None, not a list of rewards"),
    (lambda **kw: 1.0, "'<lambda>' returned float 1.0, not a list of rewards"),
    (lambda **kw: "1.0 0 0", "'<lambda>' returned str '1.0 0 0', not a list of rewards"),
    (lambda **kw: {"a": 1}, "'<lambda>' returned dict {'a': 1}, not a list of rewards"),
    (lambda **kw: [[1.0]] * 3, "'<lambda>' returned list [1.0] for completion 0"),
    (lambda **kw: torch.ones(3, 1), "'<lambda>' returned Tensor tensor("),
    (lambda **kw: [1j, 0, 0], "'<lambda>' returned complex 1j for completion 0"),
])
def test_a_bad_function_is_one_line_naming_it(fn, words):
    funcs = [RewardFunction("format", lambda completions, **kw: [1.0] * len(completions)),
             RewardFunction(getattr(fn, "__name__", "x"), fn)]
    with pytest.raises(PipelineError) as exc:
        _score(funcs, ["a", "b", "c"])
    assert _one_line(exc).startswith(f"grpo.reward_funcs[1] {words}")


def test_an_async_function_that_raises_is_one_line_and_nothing_is_left_unawaited():
    async def fails(completions, **kwargs):
        raise ValueError("service said\nno")

    async def fine(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(PipelineError) as exc:
        _score([RewardFunction("fine", fine), RewardFunction("fails", fails)], ["a", "b"])
    assert _one_line(exc) == ("grpo.reward_funcs[1] 'fails' failed on 2 completions: "
                              "ValueError: service said no")
    made = []

    def started(completions, **kwargs):
        made.append(fine(completions))
        return made[-1]

    with pytest.raises(PipelineError, match=r"reward_funcs\[1\] '_boom' failed"):
        _score([RewardFunction("fine", started), RewardFunction("_boom", _boom)], ["a"])
    assert inspect.getcoroutinestate(made[0]) == "CORO_CLOSED"  # closed, not left unawaited


def test_a_doc_typo_fails_as_in_trl(tmp_path):
    path = _write(tmp_path, "example_1.py", TRL_DOC_EXAMPLE_1)
    funcs = load_reward_functions([f"{path}:reward_func"], RewardOptions())
    with pytest.raises(TypeError, match="completions_ids"):
        _trl_calculate_rewards(funcs, ["Q"], ["a"], _ids(2), {})
    with pytest.raises(PipelineError) as exc:
        _score(funcs, ["a"], ids=_ids(2))
    assert _one_line(exc).startswith("grpo.reward_funcs[0] 'reward_func' failed on 1 "
                                     "completions: TypeError: ")
    assert "completions_ids" in str(exc.value)


def test_an_unknown_name_lists_the_built_ins_and_the_reference_form():
    with pytest.raises(PipelineError) as exc:
        load_reward_functions(["format", "corectness"], RewardOptions())
    message = _one_line(exc)
    assert message.startswith("grpo.reward_funcs[1] 'corectness': no such built-in reward "
                              "function (did you mean 'correctness'?)")
    assert f"built-ins: {', '.join(sorted(BUILT_INS))}" in message
    assert "correctness, format, length, soft_overlong_punishment" in message
    assert "'package.module:function'" in message and "'path/to/file.py:function'" in message


def test_a_reference_that_is_not_a_function_is_one_line(tmp_path):
    path = _write(tmp_path, "rewards.py", "THRESHOLD = 0.5\nimport torch\nMODEL = "
                  "torch.nn.Linear(2, 1)\n")
    cases = [(f"{path}:THRESHOLD", "grpo.reward_funcs[0] '{ref}': float object is not callable"),
             (f"{path}:MODEL", "grpo.reward_funcs[0] '{ref}': a model as a reward function is "
                               "not supported"),
             (f"{path}:missing", "grpo.reward_funcs[0]: cannot import '{ref}'"),
             (f"{tmp_path}/nowhere.py:f", "grpo.reward_funcs[0]: cannot import '{ref}'"),
             ("", "grpo.reward_funcs[0]: '' is not a reward function name")]
    for ref, words in cases:
        with pytest.raises(PipelineError) as exc:
            load_reward_functions([ref], RewardOptions())
        assert _one_line(exc).startswith(words.format(ref=ref)), ref


def test_a_column_named_like_an_argument_is_one_line():
    [fn] = load_reward_functions(["format"], RewardOptions())
    with pytest.raises(PipelineError) as exc:
        _score([fn], ["a"], {"completions": ["x"]})
    assert "column 'completions' has the name of an argument" in _one_line(exc)


def test_the_same_name_twice_is_made_unique_in_list_order(tmp_path):
    path = _write(tmp_path, "mine.py", """
        def format(completions, **kwargs):
            return [0.0] * len(completions)

        def format_2(completions, **kwargs):
            return [2.0] * len(completions)
        """)
    other = _write(tmp_path, "other.py", "from mine import format\n")
    refs = ["format", f"{path}:format", f"{path}:format_2", "format", f"{other}:format",
            "length", "length"]
    sys.path.insert(0, str(tmp_path))
    try:
        funcs = load_reward_functions(refs, RewardOptions())
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mine", None)
    assert [f.name for f in funcs] == ["format", "format_2", "format_2_2", "format_3",
                                       "format_4", "length", "length_2"]
    assert load_reward_functions(refs[:2], RewardOptions())[1].name == "format_2"
    got = _score(funcs[:4], ["#### 1"])
    _assert_same(got, torch.tensor([[1.0, 0.0, 2.0, 1.0]]))


# -- advantages ------------------------------------------------------------------------------

def _rewards(seed: int, n: int, funcs: int) -> torch.Tensor:
    """Rewards with what matters: ties (zero-std groups), None (NaN) for some functions, rows
    no function scored, a group with one scored row."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (n, funcs), generator=g).float() / 2
    noisy = torch.rand(n, funcs, generator=g) < 0.3
    r = torch.where(noisy, r + torch.randn(n, funcs, generator=g), r)
    r[torch.rand(n, funcs, generator=g) < 0.2] = NAN
    r[1] = NAN  # row 1 is never scored: with 2 generations, group 0 has one scored row
    return r


CASES = [(seed, n, funcs, groups, scale)
         for seed, (n, funcs, groups) in enumerate([(8, 1, 4), (8, 3, 4), (12, 2, 3), (6, 2, 1),
                                                    (16, 3, 2), (4, 1, 4)])
         for scale in ("group", "batch", "none")]


@pytest.mark.parametrize("seed,n,funcs,num_generations,scale", CASES)
def test_advantages_and_statistics_are_trls(seed, n, funcs, num_generations, scale):
    rewards = _rewards(seed, n, funcs)
    weights = torch.tensor([1.0, 0.5, -2.0][:funcs])
    got, stats = group_advantages(rewards, weights, num_generations, scale)
    want, metrics = _trl_advantages(rewards, weights, num_generations, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert set(stats) == set(metrics)
    for key, value in stats.items():
        assert value.shape == () and value.device == rewards.device
        assert math.isclose(value.item(), metrics[key], rel_tol=0, abs_tol=0) or (
            math.isnan(value.item()) and math.isnan(metrics[key])), key


def test_advantages_by_hand():
    # TRL's formulas: weighted nansum, group mean, Bessel std + 1e-4; unscored rows out
    rewards = torch.tensor([[1.0, 0.0], [0.0, NAN], [NAN, NAN], [1.0, 1.0],   # group 1
                            [0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])  # a tie
    weights = torch.tensor([1.0, 2.0])
    got, stats = group_advantages(rewards, weights, 4, "group")
    r = [1.0, 0.0, 3.0]  # row 2 unscored
    mean = sum(r) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 2)
    want = [(x - mean) / (std + 1e-4) for x in r]
    torch.testing.assert_close(got, torch.tensor([want[0], want[1], 0.0, want[2]] + [0.0] * 4))
    everything = r + [1.5] * 4
    assert math.isclose(stats["reward"].item(), sum(everything) / 7, rel_tol=1e-6)
    assert math.isclose(stats["reward_std"].item(), float(np.std(everything, ddof=1)),
                        rel_tol=1e-6)
    assert stats["frac_reward_zero_std"].item() == 0.5
    assert math.isclose(stats["rewards/1/mean"].item(), (0 + 1 + 0.5 * 4) / 6, rel_tol=1e-6)
    none, _ = group_advantages(rewards, weights, 4, "none")
    torch.testing.assert_close(none, torch.tensor([1 - mean, 0 - mean, 0.0, 3 - mean] + [0.0] * 4))


def test_nanstd_is_trls():
    from trl.trainer.utils import nanstd as trl_nanstd

    for seed in range(3):
        x = _rewards(seed, 12, 4)
        x[:, 2] = NAN
        x[:5, 3] = NAN
        torch.testing.assert_close(nanstd(x), trl_nanstd(x), rtol=0, atol=0, equal_nan=True)
        for dim in (0, 1):
            torch.testing.assert_close(nanstd(x, dim=dim), trl_nanstd(x, dim=dim), rtol=0,
                                       atol=0, equal_nan=True)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_never_read_a_value_back(scale):
    """On the meta device a read-back (.item(), .tolist(), a tensor's truth) raises; on a GPU,
    torch's sync debug mode does."""
    rewards = _rewards(0, 8, 2)
    advantages, stats = group_advantages(rewards.to("meta"), torch.ones(2), 4, scale)
    assert advantages.device.type == "meta" and {v.device.type for v in stats.values()} == {
        "meta"}
    with pytest.raises(RuntimeError):
        advantages.sum().item()  # the check can fail
    if torch.cuda.is_available():
        cuda, weights = rewards.cuda(), torch.ones(2, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            advantages, stats = group_advantages(cuda, weights, 4, scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want, _ = group_advantages(rewards, torch.ones(2), 4, scale)
        torch.testing.assert_close(advantages.cpu(), want)


def test_bad_advantage_arguments_are_refused():
    rewards = torch.zeros(6, 2)
    with pytest.raises(ValueError, match="scale 'grp'"):
        group_advantages(rewards, torch.ones(2), 3, "grp")
    with pytest.raises(ValueError, match="6 completions are not whole groups of 4"):
        group_advantages(rewards, torch.ones(2), 4, "group")
    with pytest.raises(ValueError, match=r"\(3,\) weights for 2 reward functions"):
        group_advantages(rewards, torch.ones(3), 3, "group")
    same, _ = group_advantages(rewards, torch.ones(2), 3, True)  # TRL's bool spelling
    torch.testing.assert_close(same, torch.zeros(6))
