"""DAPO's dynamic sampling for any rollout method (`dynamic_sampling`, `max_resample_times`):
a group whose rewards have no spread teaches nothing (its advantages are 0), so it is
replaced by the group of another train prompt before the advantages are taken.

Which prompt replaces it is a pure function of the run's seed, the step, the round and the
group's position in the step's global batch (`draw_rows`, mixed as
engine.recipe.grpo.run.prompt_seeds mixes them), and so are its completions' sampling seeds:
a run resumed from a checkpoint draws and samples exactly what the uninterrupted run did, and
2 ranks x b prompts draw what 1 rank x 2b does. The replacement happens inside this rank's
rollout (a group's completions live on one rank), so no collective is added; the logged share
of replaced groups travels with the gathered completion columns.

The pieces here are tensor-level: which groups have no spread, and the training rows of
several micro-batches joined into one (re-padded: prompts on the left, completions on the
right) and split back, so a replaced group's rows can come from a batch of another width.
"""

from __future__ import annotations

import torch

from finetune.datatypes.encoding import IGNORE_INDEX

#: the training rows' tensors (engine.recipe.grpo.run.GRPORun.completion_batch), with what
#: pads them: prompt columns on the left, completion columns on the right
ROW_KEYS = ("input_ids", "attention_mask", "completion_mask", "labels")


def no_spread(per_func: torch.Tensor, group: int) -> torch.Tensor:
    """[N / group] bool: the groups in which every reward function gave each of its scored
    completions the same value (a function's None left out), so no aggregation of them
    (a weighted sum, GDPO's per-function normalisation) can tell the completions apart. A
    group's KL penalty (RLOO's beta) or a reward_clip_range that flattens different rewards
    is not looked at: it is the rewards' spread that decides, as DAPO's filter does."""
    grouped = per_func.view(-1, group, per_func.shape[1])
    first = grouped.nanmean(dim=1, keepdim=True)  # the scored completions' common value
    same = torch.isnan(grouped) | torch.isclose(grouped, first.expand_as(grouped))
    return same.all(dim=2).all(dim=1)


def draw_rows(seed: int, step: int, attempt: int, positions: list[int], rows: int) -> list[int]:
    """The train rows (of `rows`) that replace the groups at `positions` of step `step`'s
    global batch in round `attempt` (1, 2, ...): one seeded draw per position."""
    out = []
    for position in positions:
        mixed = ((seed * 1_000_003 + step) * 1_000_033 + attempt) * 998_244_353 + position
        g = torch.Generator().manual_seed(mixed % (2**63 - 1))
        out.append(int(torch.randint(rows, (1,), generator=g)))
    return out


def refill_seeds(seed: int, step: int, attempt: int, positions: list[int]) -> list[int]:
    """The sampling seeds of the replacing groups: distinct from every step's prompt seeds
    (engine.recipe.grpo.run.prompt_seeds) by the round mixed in."""
    return [((((seed * 1_000_003 + step) * 1_000_033 + position) * 1_000_037 + attempt)
             * 7_919) % (2**63 - 1) for position in positions]


def join_batches(batches: list[dict], pad_id: int) -> dict:
    """The training rows of several micro-batches as one: prompt columns left-padded to the
    widest prompt, completion columns right-padded to the longest completion."""
    prompt = max(b["input_ids"].shape[1] - b["completion_mask"].shape[1] for b in batches)
    length = max(b["completion_mask"].shape[1] for b in batches)
    fills = {"input_ids": pad_id, "attention_mask": 0, "completion_mask": 0,
             "labels": IGNORE_INDEX}
    out = {}
    for key in ROW_KEYS:
        parts = []
        for b in batches:
            x, t = b[key], b["completion_mask"].shape[1]
            if key in ("input_ids", "attention_mask"):
                left, right = prompt - (x.shape[1] - t), length - t
            else:
                left, right = 0, length - t
            parts.append(torch.nn.functional.pad(x, (left, right), value=fills[key]))
        out[key] = torch.cat(parts)
    return out


def split_batch(batch: dict, sizes: list[int]) -> list[dict]:
    """`join_batches`' inverse in row counts: micro-batches of `sizes` rows (each keeps the
    joined width)."""
    parts = {key: batch[key].split(sizes) for key in ROW_KEYS}
    return [{key: parts[key][i] for key in ROW_KEYS} for i in range(len(sizes))]
