"""Reward functions' scores for a batch of completions, called as TRL 1.16's GRPOTrainer calls
them (`_calculate_rewards`): keyword arguments `prompts`, `completions`, `completion_ids`,
every other column of the rows, `trainer_state` and the logging callables; the async ones
awaited together. A failure, or a return value that is not one number (or None) per
completion, is one line naming the function's config entry. `score_completions` is the
rollout's side: a generator's `Completions` decoded and handed over with their rows' columns,
so a reward means the same in training, in evaluation and in the registry gate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import numpy as np
import torch

from engine.rollout.generator import Completions
from engine.rollout.rewards import ARGUMENTS, NOT_PASSED, RewardFunction, shown
from finetune.errors import PipelineError, warn


def _nothing(*args, **kwargs) -> None:
    return None


def score(funcs: list[RewardFunction], prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list], trainer_state=None, *,
          key: str, log_extra: Callable[[str, list], None] | None = None,
          log_metric: Callable[[str, float], None] | None = None,
          environments: list | None = None) -> torch.Tensor:
    """Each function's rewards for each completion: [N, len(funcs)] float32 on the CPU, NaN
    where a function returned None. `key`: the config key the functions came from, which a
    failure names with the function's index (`grpo.reward_funcs[1] 'name'`; the warning about
    unscored completions names its section, `grpo`). `columns`: the rows' other columns
    (lists of N); `trainer_state`: what TRL passes as `trainer_state` (a TrainerState, or any
    object with global_step / max_steps / epoch); `log_extra` / `log_metric`: TRL's logging
    callables, no-ops when not given; `environments`: each completion's environment instance,
    passed as TRL passes it (`environments=`) where the rollout had them. Functions run in
    order, then the async ones together."""
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"score: {len(prompts)} prompts, {n} completions and "
                         f"{len(completion_ids)} completion_ids must be as many")
    kwargs: dict[str, Any] = {}
    for column, values in columns.items():
        if column in NOT_PASSED:
            continue
        if column in ARGUMENTS or column == "environments":
            raise PipelineError(f"the rows' column '{column}' has the name of an argument TRL "
                                "passes a reward function; rename the column")
        if len(values) != n:
            raise ValueError(f"score: column '{column}' has {len(values)} values for "
                             f"{n} completions")
        kwargs[column] = list(values)
    kwargs.update(trainer_state=trainer_state, log_extra=log_extra or _nothing,
                  log_metric=log_metric or _nothing)
    if environments is not None:
        kwargs["environments"] = list(environments)

    outputs: list[Any] = [None] * len(funcs)
    pending: dict[int, Any] = {}  # index -> coroutine
    try:
        for i, func in enumerate(funcs):
            try:
                out = func.fn(prompts=prompts, completions=completions,
                              completion_ids=completion_ids, **kwargs)
            except Exception as exc:
                raise _failed(i, func, n, exc, key) from None
            if inspect.isawaitable(out):
                pending[i] = out
            else:
                outputs[i] = out
    except BaseException:
        for coroutine in pending.values():
            if inspect.iscoroutine(coroutine):
                coroutine.close()  # not awaited: no "never awaited" warning
        raise
    if pending:
        for i, result in _await_all(pending).items():
            if isinstance(result, BaseException):
                raise _failed(i, funcs[i], n, result, key) from None
            outputs[i] = result

    table = [_rewards(out, n, f"{key}[{i}] '{func.name}'")
             for i, (func, out) in enumerate(zip(funcs, outputs))]
    rewards = torch.tensor(table, dtype=torch.float32).reshape(len(funcs), n).T.contiguous()
    if funcs and n:
        unscored = torch.isnan(rewards).all(dim=1)
        if unscored.any():
            rows = unscored.nonzero().flatten().tolist()
            section = key.rpartition(".")[0] or key
            warn(f"{section}: every reward function returned None for {len(rows)} of {n} "
                 f"completions (first: completion {rows[0]}); they are not scored and get "
                 "advantage 0")
    return rewards


def _failed(i: int, func: RewardFunction, n: int, exc: BaseException, key: str
            ) -> PipelineError:
    label = f"{key}[{i}] '{func.name}'"
    if isinstance(exc, PipelineError):  # a built-in's own explanation
        return PipelineError(f"{label}: {exc}")
    return PipelineError(f"{label} failed on {n} completions: {type(exc).__name__}: {exc}")


def _await_all(pending: dict[int, Any]) -> dict[int, Any]:
    """index -> result or raised exception, the awaitables run together (asyncio.gather)."""
    async def gather() -> dict[int, Any]:
        results = await asyncio.gather(*pending.values(), return_exceptions=True)
        return dict(zip(pending, results))

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside a loop
        return pool.submit(asyncio.run, gather()).result()


def _rewards(out: Any, n: int, label: str) -> list[float]:
    """One function's return value as n floats (None -> NaN), or one line saying what is
    wrong with it."""
    if isinstance(out, (torch.Tensor, np.ndarray)) and out.ndim == 1:
        out = out.tolist()
    if isinstance(out, (str, bytes, Mapping, torch.Tensor, np.ndarray)) or not isinstance(
            out, Iterable):
        raise PipelineError(f"{label} returned {shown(out)}, not a list of rewards (one number "
                            "per completion, None where it does not apply)")
    values = list(out)
    if len(values) != n:
        raise PipelineError(f"{label} returned {len(values)} rewards for {n} completions (one "
                            "number per completion, None where it does not apply)")
    rewards = []
    for j, value in enumerate(values):
        if value is None:
            rewards.append(math.nan)
        elif isinstance(value, numbers.Real):
            rewards.append(float(value))
        elif _real_scalar(value):
            rewards.append(float(value))
        else:
            raise PipelineError(f"{label} returned {shown(value)} for completion {j}: a reward "
                                "is a number, or None where it does not apply")
    return rewards


def _real_scalar(value: Any) -> bool:
    """A 0-d tensor or array, or a numpy scalar, of a real (or bool) type."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_complex()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.ndim == 0 and value.dtype.kind in "biuf"
    return False


def score_completions(tokenizer, funcs, reward_inputs: list[str], done: Completions,
                      repeat: int, trainer_state: Any = None, *, key: str,
                      prompts: list | None = None, environments: list | None = None
                      ) -> tuple[torch.Tensor, list, list[str]]:
    """([rows * repeat, functions] rewards, the prompts, the completion texts) of `done`, the
    `repeat` completions of each row (rows' order, TRL's): the reward functions get the prompt
    (a conversation stays a message list, and its completion is one too), the completion,
    its token ids and every other column of the row. `key`: as `score`'s; `prompts`: each
    completion's prompt where it is not its row's (an environment's observation added:
    engine.rollout.episodes); `environments`: as `score`'s."""
    rows = [json.loads(r) for r in reward_inputs]
    if prompts is None:
        prompts = [row["prompt"] for row in rows for _ in range(repeat)]
    keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")
    columns = {column: [row.get(column) for row in rows for _ in range(repeat)]
               for column in keys}
    lengths = done.mask.sum(-1).tolist()
    completion_ids = [ids[:n] for ids, n in zip(done.ids.tolist(), lengths)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": text}] if isinstance(p, list) else text
                   for text, p in zip(texts, prompts)]
    rewards = score(funcs, prompts, completions, completion_ids, columns,
                    trainer_state=trainer_state, key=key, environments=environments)
    return rewards, prompts, texts
