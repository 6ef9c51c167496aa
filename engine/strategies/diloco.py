"""DiLoCo: H local steps per worker, then one pseudo-gradient all-reduce and an outer step.

Every worker holds the same global copy of the trainable parameters. After H inner steps the
pseudo-gradient is the token-weighted mean over workers of (global - local); the outer optimizer
(SGD with Nesterov momentum by default) applies it to the global copy, which is copied back into
every worker's model. Weighting by each worker's target tokens makes H = 1 with inner SGD and
outer SGD(lr=1) exactly a DDP step. Nothing else is communicated between syncs: the inner loss is
normalised by the worker's own tokens, so a slow link costs one all-reduce per H steps.

Post-local SGD (Lin et al.) is the special case outer SGD(lr=1, momentum=0) with
`local_sgd_start_step`: before it, gradients are averaged every step as in DDP. With
`post_local_gradient_allreduce` the local phase is hierarchical (torch's PostLocalSGDState with
its default intra-node subgroup): gradients are still averaged every step within each node,
token-weighted over the node, and only the outer sync crosses nodes.

With `fsdp_group_size` g > 1 a worker is g processes that shard its model with FSDP2
(OpenDiLoCo's layout): a (workers x g) device mesh, FSDP2 over each row, and the pseudo-gradient
all-reduce over each column, on local shards. The per-worker parallelism is an inner strategy
(single or FSDP2) that this class delegates to.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import get_scheduler

from engine.objective.optim import optimizer_class
from engine.process.comm import all_reduce, all_reduce_count, all_reduce_flat
from engine.process.distributed import node_group
from engine.strategies.base import Strategy

OUTER_SCHEDULES = {"none": "constant", "cosine": "cosine", "linear": "linear",
                   "polynomial": "polynomial"}


class _GlobalParams(torch.nn.Module):
    """The global copy as a module, so DCP's FQN-keyed state-dict helpers handle it and its
    outer optimizer like any model (dots are not allowed in parameter names)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"),
                                    torch.nn.Parameter(p.detach().clone()))


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor, else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


class DiLoCoStrategy(Strategy):
    name = "diloco"

    def shares_prompt_forward(self) -> bool:
        """One forward per micro-batch (see Strategy.shares_prompt_forward)."""
        return False

    def wrap(self, model):
        c = self.setup.distributed.diloco
        self.h = c.inner_steps
        self.start = c.local_sgd_start_step
        self.group_size = c.fsdp_group_size
        self.workers = self.d.world_size // self.group_size
        self.replicas = None  # process group across workers (None: all ranks)
        if self.group_size > 1:
            from engine.strategies.fsdp2 import FSDP2Strategy
            from engine.strategies.mesh import replica_mesh

            mesh = replica_mesh(self.d, self.group_size, "shard")  # workers x FSDP2 group
            self.inner = FSDP2Strategy(self.setup, self.d, self.meter)
            self.inner.wrap(model, mesh=mesh["shard"])
            self.replicas = mesh.get_group("replica")
            self._group = mesh.get_group("shard")
        else:
            self.inner = Strategy(self.setup, self.d, self.meter)
            self.inner.wrap(model)
        self.eval_lockstep = self.inner.eval_lockstep
        self.model = model
        # post_local_gradient_allreduce: the node's ranks (None: one node, the whole world)
        self.node, self.node_size = None, 1
        if c.post_local_gradient_allreduce:
            self.node = node_group(self.d)  # collective: every rank creates every group
            self.node_size = min(self.d.local_world_size, self.d.world_size)
        self.local = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.globals = _GlobalParams([(n, _local(p)) for n, p in self.local])
        klass = optimizer_class(c.outer_optimizer, "distributed.diloco.outer_optimizer")
        self.outer = klass(self.globals.parameters(), **c.outer_optimizer_kwargs(klass))
        self.outer_schedule = get_scheduler(
            OUTER_SCHEDULES[c.outer_lr_schedule], self.outer, num_warmup_steps=0,
            num_training_steps=c.diloco_loops)
        self.tokens_since_sync = 0.0
        self.outer_steps = 0
        return model

    def _local_phase(self, step: int) -> bool:
        return step >= self.start

    def loss_divisor(self, local_targets: int, step: int) -> float | torch.Tensor:
        """Local phase: the worker's (or, with post_local_gradient_allreduce, the node's)
        target count over the ranks that average gradients. A count summed over ranks stays
        on the device (no host sync per step), and so does the tokens-since-sync weight it
        adds to."""
        if not self._local_phase(step):
            return super().loss_divisor(local_targets, step)
        worker_targets: float | torch.Tensor = float(local_targets)
        if self.group_size > 1:  # FSDP2 averages gradients over the worker's group
            worker_targets = all_reduce_count(worker_targets, self.meter, "loss_normaliser",
                                              self.d.device, group=self._group, on_device=True)
        self.tokens_since_sync = self.tokens_since_sync + worker_targets
        if self.node_size > 1:  # the node averages gradients: weight by the node's targets
            node_targets = all_reduce_count(local_targets, self.meter, "loss_normaliser",
                                            self.d.device, group=self.node, on_device=True)
            return (node_targets.clamp_min(1.0) / self.node_size).float()
        if self.group_size > 1:
            return (worker_targets.clamp_min(1.0) / self.group_size).float()
        return max(worker_targets, 1.0)

    def sync_context(self, last_micro_batch: bool):
        return self.inner.sync_context(last_micro_batch)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.inner.clip_grad_norm(max_norm)

    def full_state_dict(self) -> dict | None:
        return self.inner.full_state_dict()

    def before_optimizer_step(self, step: int) -> None:
        """Before local SGD starts: average gradients over workers every step, as DDP does
        (within a worker, FSDP2 has already averaged them over the group). After it, with
        post_local_gradient_allreduce, average them over this node's ranks."""
        if not self._local_phase(step):
            size, group, kind = self.workers, self.replicas, "grad_all_reduce"
        else:
            size, group, kind = self.node_size, self.node, "post_local_grad_all_reduce"
        if size > 1:
            all_reduce_flat([_local(p.grad) for _, p in self.local], self.meter, kind,
                            group=group, divide=size)

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
            g.copy_(_local(p))

    @torch.no_grad()
    def _outer_step(self) -> dict[str, float]:
        c = self.setup.distributed.diloco
        sent_before = self.meter.total
        globals_ = list(self.globals.parameters())
        deltas = torch.cat([(g - _local(p)).reshape(-1)
                            for g, (_, p) in zip(globals_, self.local)])
        # the worker's targets since the last sync (a device tensor when summed over ranks)
        weight = torch.as_tensor(self.tokens_since_sync, dtype=torch.float64,
                                 device=deltas.device).reshape(1).clone()
        if self.workers > 1:
            deltas.mul_(weight[0])
            all_reduce(deltas, self.meter, "diloco_pseudo_grad", group=self.replicas)
            all_reduce(weight, self.meter, "diloco_token_weight", group=self.replicas)
            deltas.div_(weight[0].clamp_min(1.0))
        for g, chunk in zip(globals_, deltas.split([g.numel() for g in globals_])):
            g.grad = chunk.view_as(g).clone()
        norm = self._clip_pseudo_gradient(globals_, c.outer_grad_clip)
        lr = self.outer.param_groups[0]["lr"]
        self.outer.step()
        self.outer_schedule.step()
        self.outer.zero_grad(set_to_none=True)
        for g, (_, p) in zip(globals_, self.local):
            _local(p).copy_(g)
        self.tokens_since_sync = 0.0
        self.outer_steps += 1
        return {"outer_lr": float(lr), "pseudo_grad_norm": float(norm),
                "outer_step": float(self.outer_steps),
                "comm_bytes_outer_loop": float(self.meter.total - sent_before)}

    def _clip_pseudo_gradient(self, params, max_norm: float | None) -> torch.Tensor:
        """torch's clipping, with the norm taken over the whole pseudo-gradient (a worker's
        shards combined)."""
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads)
        if self.group_size > 1:
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self._group)  # a scalar per outer loop: not counted
            norm = sq.sqrt()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # -- checkpoint: inner optimizer state differs per worker, so each worker has its own key
    # (a worker's FSDP2 ranks fill their shards of it together);
    # the global copy and the outer optimizer are replicated across workers (DCP writes them
    # once) but, with FSDP2 workers, differ per shard: keyed by shard index then.
    def _worker(self) -> int:
        return self.d.rank // self.group_size  # mesh rows are contiguous ranks

    def _shard_key(self) -> str:
        return "" if self.group_size == 1 else f".shard{dist.get_rank(self._group)}"

    def dcp_state(self, optimizer) -> dict:
        state = super().dcp_state(optimizer)  # trainable weights + this worker's inner optim
        state[f"inner_optim.worker{self._worker()}"] = state.pop("optim")
        global_sd, outer_sd = get_state_dict(self.globals, self.outer)
        shard = self._shard_key()
        return {**state, f"outer_global{shard}": global_sd, f"outer_optim{shard}": outer_sd}

    def load_dcp_state(self, optimizer, state: dict) -> None:
        super().load_dcp_state(optimizer, {
            "model": state["model"], "optim": state[f"inner_optim.worker{self._worker()}"]})
        shard = self._shard_key()
        set_state_dict(self.globals, self.outer, model_state_dict=state[f"outer_global{shard}"],
                       optim_state_dict=state[f"outer_optim{shard}"])

    def trainer_state(self) -> dict:
        return {"outer_schedule": self.outer_schedule.state_dict(),
                "outer_steps": self.outer_steps}

    def load_trainer_state(self, state: dict) -> None:
        self.outer_schedule.load_state_dict(state["outer_schedule"])
        self.outer_steps = state["outer_steps"]
