"""On-policy rows: the student's sampled completions after their prompts, as a batch the
distillation loss trains on, masked as TRL's GKDTrainer masks them
(`generate_on_policy_outputs`): the prompt is not trained on, a completion's tokens after its
first EOS are padding (the EOS itself is trained on), a completion without one is kept whole.
"""

from __future__ import annotations

import torch

from engine.datapath.data import IGNORE_INDEX


def completion_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     completion_ids: torch.Tensor, eos_ids: int | list[int] | None
                     ) -> dict[str, torch.Tensor]:
    """{input_ids, attention_mask, labels} of prompts [b, p] (left- or right-padded, as
    `prompt_mask` says) followed by completions [b, c]; all on the device, no host sync."""
    device = completion_ids.device
    b, c = completion_ids.shape
    if eos_ids is None:
        keep = torch.ones_like(completion_ids, dtype=torch.bool)
    else:
        eos = torch.as_tensor(eos_ids, device=device).reshape(-1)
        is_eos = torch.isin(completion_ids, eos)
        # the first EOS's position, c where there is none
        first = torch.where(is_eos, torch.arange(c, device=device), c).amin(dim=1)
        keep = torch.arange(c, device=device).unsqueeze(0) <= first.unsqueeze(1)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask.to(torch.long), keep.to(torch.long)], dim=1)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :prompt_ids.shape[1]] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
