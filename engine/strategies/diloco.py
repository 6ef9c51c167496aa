"""DiLoCo: H local steps per worker, then one pseudo-gradient all-reduce and an outer step.

Every worker holds the same global copy of the trainable parameters. After H inner steps the
pseudo-gradient is the token-weighted mean over workers of (global - local); the outer optimizer
(SGD with Nesterov momentum by default) applies it to the global copy, which is copied back into
every worker's model. Weighting by each worker's target tokens makes H = 1 with inner SGD and
outer SGD(lr=1) exactly a DDP step. Nothing else is communicated between syncs: the inner loss is
normalised by the worker's own tokens, so a slow link costs one all-reduce per H steps.

Post-local SGD (Lin et al.) is the special case outer SGD(lr=1, momentum=0) with
`local_sgd_start_step`: before it, gradients are averaged every step as in DDP.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from transformers import get_scheduler

from engine.comm import all_reduce
from engine.strategies.base import Strategy

OUTER_SCHEDULES = {"none": "constant", "cosine": "cosine", "linear": "linear",
                   "polynomial": "polynomial"}


class _GlobalParams(torch.nn.Module):
    """The global copy as a module, so DCP's FQN-keyed state-dict helpers handle it and its
    outer optimizer like any model (dots are not allowed in parameter names)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]):
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"),
                                    torch.nn.Parameter(p.detach().clone()))


class DiLoCoStrategy(Strategy):
    name = "diloco"

    def wrap(self, model):
        c = self.cfg.distributed.diloco
        self.h = self.cfg.training.max_steps
        self.start = c.local_sgd_start_step
        self.model = model
        self.local = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.globals = _GlobalParams(self.local)
        klass = getattr(torch.optim, c.outer_optimizer)
        self.outer = klass(self.globals.parameters(), **c.outer_optimizer_kwargs())
        self.outer_schedule = get_scheduler(
            OUTER_SCHEDULES[c.outer_lr_schedule], self.outer, num_warmup_steps=0,
            num_training_steps=c.diloco_loops)
        self.tokens_since_sync = 0.0
        self.outer_steps = 0
        return model

    def _local_phase(self, step: int) -> bool:
        return step >= self.start

    def loss_divisor(self, local_targets: int, step: int) -> float:
        if self._local_phase(step):
            self.tokens_since_sync += local_targets
            return float(max(local_targets, 1))
        return super().loss_divisor(local_targets, step)

    def before_optimizer_step(self, step: int) -> None:
        """Before local SGD starts: average gradients every step, as DDP does."""
        if self._local_phase(step) or self.d.world_size == 1:
            return
        grads = [p.grad for _, p in self.local]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.d.world_size)
        all_reduce(flat, self.meter, "grad_all_reduce")
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))

    def after_optimizer_step(self, step: int) -> dict[str, float]:
        # `step` optimizer steps are done; steps before `start` ran synchronously.
        if step <= self.start:
            self._copy_local_to_global()
            return {}
        if (step - self.start) % self.h:
            return {}
        return self._outer_step()

    @torch.no_grad()
    def _copy_local_to_global(self) -> None:
        for g, (_, p) in zip(self.globals.parameters(), self.local):
            g.copy_(p)

    @torch.no_grad()
    def _outer_step(self) -> dict[str, float]:
        c = self.cfg.distributed.diloco
        sent_before = self.meter.total
        globals_ = list(self.globals.parameters())
        deltas = torch.cat([(g - p).reshape(-1) for g, (_, p) in zip(globals_, self.local)])
        weight = torch.tensor([self.tokens_since_sync], dtype=torch.float64,
                              device=deltas.device)
        if self.d.world_size > 1:
            deltas.mul_(self.tokens_since_sync)
            all_reduce(deltas, self.meter, "diloco_pseudo_grad")
            all_reduce(weight, self.meter, "diloco_token_weight")
            deltas.div_(max(float(weight.item()), 1.0))
        for g, chunk in zip(globals_, deltas.split([g.numel() for g in globals_])):
            g.grad = chunk.view_as(g).clone()
        norm = torch.nn.utils.clip_grad_norm_(
            globals_, c.outer_grad_clip if c.outer_grad_clip else float("inf"))
        lr = self.outer.param_groups[0]["lr"]
        self.outer.step()
        self.outer_schedule.step()
        self.outer.zero_grad(set_to_none=True)
        for g, (_, p) in zip(globals_, self.local):
            p.copy_(g)
        self.tokens_since_sync = 0.0
        self.outer_steps += 1
        return {"outer_lr": float(lr), "pseudo_grad_norm": float(norm),
                "outer_step": float(self.outer_steps),
                "comm_bytes_outer_loop": float(self.meter.total - sent_before)}

    # -- checkpoint: inner optimizer state differs per worker, so each rank keeps its own key;
    # the global copy and the outer optimizer are replicated (DCP writes them once).
    def dcp_state(self, optimizer) -> dict:
        model_sd, inner_sd = get_state_dict(self.model, optimizer)
        names = self.trainable_names()
        global_sd, outer_sd = get_state_dict(self.globals, self.outer)
        return {"model": {k: v for k, v in model_sd.items() if k in names},
                f"inner_optim.rank{self.d.rank}": inner_sd,
                "outer_global": global_sd, "outer_optim": outer_sd}

    def load_dcp_state(self, optimizer, state: dict) -> None:
        set_state_dict(self.model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state[f"inner_optim.rank{self.d.rank}"],
                       options=StateDictOptions(strict=False))
        set_state_dict(self.globals, self.outer, model_state_dict=state["outer_global"],
                       optim_state_dict=state["outer_optim"])

    def trainer_state(self) -> dict:
        return {"outer_schedule": self.outer_schedule.state_dict(),
                "outer_steps": self.outer_steps}

    def load_trainer_state(self, state: dict) -> None:
        self.outer_schedule.load_state_dict(state["outer_schedule"])
        self.outer_steps = state["outer_steps"]
