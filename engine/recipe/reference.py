"""The reference model a method compares its policy with: DPO's implicit reward today, and the
KL term of the next methods (KTO, GRPO's beta), so it is built once, here, not inside a run.

The reference is the base model:
- under PEFT, the policy itself with its adapter disabled: no second copy in memory (TRL's
  way), unless the adapter's initialisation rewrote the base (PiSSA, OLoRA): then a frozen copy;
- for full fine-tuning, a frozen copy of the base loaded once (each rank holds a whole copy,
  also under FSDP2, whose sharded policy has no base left to disable into).

A method whose data does not change during training may precompute the reference's scores of
every training row once, before the first step (`precompute`), and read a step's rows from
that table (`ReferenceTable.lookup`, by the rows the loader took): each step then costs one
forward and backward of the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from engine.modeling.adapter import adapter_disabled, base_rewritten, has_adapter
from engine.modeling.model import load_base_model

#: (model, device batch) -> [rows, width] scores of the batch's split rows
Score = Callable[[torch.nn.Module, dict], torch.Tensor]


def lockstep_batches(rows: int, size: int, rank: int, world: int
                     ) -> Iterator[tuple[list[int], int]]:
    """(row indices, how many are real) of this rank's batches over `rows` rows: rank r takes
    rows r, r + world, ...; every rank runs the same number of batches (a sharded model's
    forward is a collective), the short ones padded with row 0."""
    mine = list(range(rank, rows, world))
    per_rank = -(-rows // world)
    for start in range(0, per_rank, size):
        chunk = mine[start:start + size]
        width = min(size, per_rank - start)
        yield chunk + [0] * (width - len(chunk)), len(chunk)


class ReferenceTable:
    """A reference's precomputed scores of every training row: [rows, width]."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def lookup(self, batch: dict) -> torch.Tensor:
        """[b, width]: the rows of this micro-batch (`rows`: the split rows the loader took)."""
        return self.table[batch["rows"]]


class Reference:
    """The base model beside a run's policy: see the module docstring."""

    def __init__(self, policy: torch.nn.Module, frozen: torch.nn.Module | None = None):
        self.policy, self.frozen = policy, frozen

    @classmethod
    def of(cls, run) -> "Reference":
        """The reference of `run` (engine.state.run_view.RunView): its unwrapped module with
        the adapter disabled, or a frozen copy of the base when it has no adapter or the
        adapter's initialisation rewrote the base (PiSSA, OLoRA: disabled, it is the residual)."""
        module = run.strategy.module
        if has_adapter(module) and not base_rewritten(module):
            return cls(module)
        frozen = load_base_model(run.cfg.model, run.paths.project_root, log=run.log)
        return cls(module, frozen.to(run.dist.device).eval().requires_grad_(False))

    @contextlib.contextmanager
    def model(self):
        """The module whose forward is the reference's."""
        if self.frozen is not None:
            yield self.frozen
            return
        with adapter_disabled(self.policy):
            yield self.policy

    @torch.no_grad()
    def score(self, score: Score, batch: dict) -> torch.Tensor:
        with self.model() as model:
            return score(model, batch)

    def precompute(self, dataset, batch_of: Callable[[object, list[int]], dict], score: Score,
                   width: int, size: int, dist, log: Callable[[str], None],
                   what: str = "rows") -> ReferenceTable:
        """The reference's [rows, width] scores of every row of `dataset`: each rank scores its
        share (`batch_of(dataset, indices)` makes a device batch), the table is summed over
        ranks (every row is written by one rank)."""
        table = torch.zeros(len(dataset), width, dtype=torch.float32, device=dist.device)
        for indices, real in lockstep_batches(len(dataset), size, dist.rank, dist.world_size):
            scored = self.score(score, batch_of(dataset, indices))
            table[indices[:real]] = scored[:real].float()
        if dist.world_size > 1:
            torch.distributed.all_reduce(table)
        log(f"[train] reference log-probabilities of {len(dataset)} {what} precomputed")
        return ReferenceTable(table)
