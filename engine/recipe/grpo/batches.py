"""What GRPO's loader hands the run: prompts, left-padded (completions are appended on the
right when generated), with their rows' other columns for the reward functions; and the
repetition of a step's prompts for `num_iterations`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from engine.rollout.generator import left_pad

#: a prompt split's columns the run reads (finetune.datatypes.prompt writes them)
PROMPT_COLUMNS = ("input_ids", "reward_inputs")


def collate_prompts(pad_id: int) -> Callable[[list[dict]], dict]:
    def collate(rows: list[dict]) -> dict:
        ids, mask = left_pad([r["input_ids"] for r in rows], pad_id)
        return {"input_ids": ids, "attention_mask": mask,
                "reward_inputs": [r.get("reward_inputs") or '{"prompt": ""}' for r in rows]}

    return collate


def repeat_steps(opened: Callable[[int, int], Iterator[dict]], epoch: int, start: int,
                 accum: int, repeats: int) -> Iterator[dict]:
    """The loader's micro-batches with each optimizer step's `accum` of them coming `repeats`
    times in a row (TRL's RepeatSampler for num_iterations). Positions are counted in the
    repeated stream (an epoch is `repeats` times longer), so a checkpoint's position resumes
    here: `start` is a position in the repeated stream."""
    group = accum * repeats
    skip = start % group
    batches = opened(epoch, (start // group) * accum)
    while True:
        step = [next(batches) for _ in range(accum)]
        at_epoch, index = step[0]["key"].tolist()
        base = (index // accum) * group
        for repeat in range(repeats):
            for j, batch in enumerate(step):
                if skip:
                    skip -= 1
                    continue
                out = dict(batch)
                out["key"] = torch.tensor([at_epoch, base + repeat * accum + j])
                yield out
