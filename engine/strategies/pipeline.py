"""Pipeline parallelism: the decoder's stages over the ranks, run by a torch schedule.

Every rank reads the same batches (the pipeline is one replica); each training micro-batch is
padded to `data.max_seq_length` (stages pass fixed-shape activations, so the schedule's shapes
are inferred once) and cut into `n_microbatches`. The last stage's loss is the token-weighted
sum over the output layer applied in row chunks (engine.objective.loss's way: no full fp32
logits), divided by the step's target count, so the gradients equal single-process training's.
The schedule runs forward and backward; the optimizer, clipping (a global norm over the stages) and checkpoints
are the loop's as usual: DCP saves each rank's stage under the original parameter names, and the
export gathers the stages into one HF/PEFT folder.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from engine.datapath.data import IGNORE_INDEX, collate, count_targets, take_rows
from engine.modeling.compile import block_names, compile_part
from engine.modeling.pipeline_stages import cut_stages, decoder_of, stage_ids
from engine.objective.loss import head_loss_sum
from engine.process.comm import all_reduce, all_reduce_count, all_reduce_flat
from engine.process.distributed import Dist, all_reduce_sum
from engine.strategies.base import Strategy

#: fills the columns a batch is padded to max_seq_length with: after every real token, with
#: label -100, so any id does (causal attention never looks ahead)
PAD_ID = 0


def say(text: str) -> None:
    """A debug switch's output: one write per block (line and newline together), so the
    ranks' lines do not run into each other."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def record_actions(stage: PipelineStage, actions: list[str]) -> None:
    """debug_pipeline: append each chunk this stage runs to `actions`, as torch's schedule IR
    names them (`<stage>F<micro-batch>` forward, `B` full backward, `I` input and `W` weight
    gradient: the zero-bubble halves), in the order the schedule really runs them."""
    forward, backward, weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                 stage.backward_weight_one_chunk)
    s = stage.stage_index

    def forward_one_chunk(chunk, *args, **kwargs):
        actions.append(f"{s}F{chunk}")
        return forward(chunk, *args, **kwargs)

    def backward_one_chunk(chunk, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        actions.append(f"{s}{'B' if full else 'I'}{chunk}")
        return backward(chunk, *args, **kwargs)

    def backward_weight_one_chunk(chunk, *args, **kwargs):
        actions.append(f"{s}W{chunk}")
        return weight(chunk, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


class PipelineStrategy(Strategy):
    name = "pipeline"
    eval_lockstep = True

    def shares_prompt_forward(self) -> bool:
        """One forward per micro-batch (see Strategy.shares_prompt_forward)."""
        return False

    # -- the (data-parallel x pipeline) layout: rank = replica * pipeline_ranks + pp_rank ---
    @property
    def pipe(self) -> int:
        """Ranks per pipeline."""
        return self.setup.distributed.pipeline.pipeline_ranks(self.d.world_size)

    @property
    def replicas(self) -> int:
        return self.setup.distributed.pipeline.data_parallel_size

    @property
    def batch_replicas(self) -> int:
        """A pipeline's ranks all hold its batch: metrics divide the summed counts by this."""
        return self.pipe

    def data_view(self, d: Dist) -> Dist:
        """Each pipeline reads one stream of batches: data rank `replica` of `replicas`."""
        replica = d.rank // self.pipe
        return replace(d, rank=replica, world_size=self.replicas,
                       local_world_size=self.replicas, main_rank=0)

    # -- building ------------------------------------------------------------------------
    def keep_own_part(self, model: torch.nn.Module) -> torch.nn.Module:
        """This rank's stages; the rest of the model is removed (never placed or read)."""
        pp, world, pipe = self.setup.distributed.pipeline, self.d.world_size, self.pipe
        self.num_stages = pp.stages(world)
        first = self.d.rank - self.d.rank % pipe  # this pipeline's first global rank
        self.first = first
        self.ids = stage_ids(self.d.rank - first, pipe, pp.resolved_stages_per_rank,
                             pp.resolved_stage_type)
        self.rank_of = {s: first + r for r in range(pipe)  # stage -> global rank
                        for s in stage_ids(r, pipe, pp.resolved_stages_per_rank,
                                           pp.resolved_stage_type)}
        # groups: this pipeline's ranks (point-to-point, the gradient norm) and this stage's
        # replicas (gradient sums); None = every rank, the layout without replicas
        self.pp_group = self.dp_group = None
        if self.replicas > 1:
            from engine.strategies.mesh import replica_mesh

            mesh = replica_mesh(self.d, pipe, "pp")  # data-parallel copies x a pipeline
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("replica")
        lm, inner = decoder_of(model)
        self.blocks = block_names(model)  # what torch_compile_scope: blocks compiles
        self.hidden = lm.config.hidden_size
        self.act_dtype = inner.embed_tokens.weight.dtype  # the residual stream's
        self.stage_modules, self.ranges, layout = cut_stages(model, self.ids, self.num_stages,
                                                             pp.model_splitter)
        if pp.debug_split_model and self.d.is_main:
            owners = {s: r - first for s, r in self.rank_of.items()}
            say("[pipeline] split: " + "; ".join(
                f"{line} (rank {owners[s]})" for s, line in enumerate(layout)))
        self.head = lm.lm_head if self.num_stages - 1 in self.ids else None
        return model

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        pp, world = self.setup.distributed.pipeline, self.d.world_size
        self.n_micro = pp.microbatches(world)
        self._sums: list[torch.Tensor] = []
        self._divisor = 1.0
        self.schedules: dict[int, object] = {}  # rows per batch -> training schedule
        self._actions: list[str] = []  # debug_pipeline: what this rank's stages ran
        self.model = model
        if self.d.is_main:
            spans = ", ".join(f"{s}: layers {r.start}-{r.stop - 1}"
                              for s, r in enumerate(self.ranges))
            print(f"[train] pipeline {pp.schedule}: {self.num_stages} stages ({spans}), "
                  f"{pp.resolved_stages_per_rank} per rank ({pp.resolved_stage_type}), "
                  f"{self.n_micro} micro-batches, {self.replicas} data-parallel "
                  f"replica{'s' if self.replicas > 1 else ''}", flush=True)
        if pp.debug_model_init:
            say(self._init_details())
        if pp.debug_model_params:
            say("\n".join(
                f"[pipeline rank {self.d.rank}] param {name} {tuple(p.shape)} "
                f"{str(p.dtype).removeprefix('torch.')} {p.device}"
                f"{' trainable' if p.requires_grad else ''}"
                for name, p in model.named_parameters()))
        return model

    def _init_details(self) -> str:
        """debug_model_init: what this rank built, as it is before the first step."""
        t = self.setup.training
        params = list(self.module.parameters())
        on_meta = sum(p.numel() for p in params if p.is_meta)
        stages = ", ".join(
            f"{s} ({type(m).__name__}: {len(m.layers)} layers"
            f"{', embed_tokens' if m.first else ''}{', norm' if m.last else ''})"
            for s, m in zip(self.ids, self.stage_modules))
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        return (f"[pipeline rank {self.d.rank}] init: stages {stages}; "
                f"construct_model_on {t.construct_model_on}; "
                f"{sum(p.numel() for p in params):,} parameters on "
                f"{', '.join(sorted({str(p.device) for p in params}))} ({', '.join(dtypes)}), "
                f"{sum(p.numel() for p in params if p.requires_grad):,} trainable, "
                f"{on_meta:,} still on meta; output layer "
                f"{'here' if self.head is not None else 'elsewhere'}")

    def _schedule(self, rows: int):
        """The training schedule for batches of `rows` rows (a stage's activation shapes are
        fixed once inferred)."""
        key = rows
        if key not in self.schedules:
            modules, t = self.stage_modules, self.setup.training
            if t.torch_compile:
                modules = [compile_part(m, t, self.blocks) for m in modules]
            stages = [PipelineStage(m, s, self.num_stages, self.d.device, group=self.pp_group)
                      for m, s in zip(modules, self.ids)]
            klass = get_schedule_class(self.setup.distributed.pipeline.schedule)
            single = issubclass(klass, PipelineScheduleSingle)
            self.schedules[key] = klass(stages[0] if single else stages, self.n_micro,
                                        loss_fn=self._loss, scale_grads=False)
            if self.setup.distributed.pipeline.debug_pipeline:
                for stage in stages:
                    record_actions(stage, self._actions)
        return self.schedules[key]

    # -- one step ------------------------------------------------------------------------
    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline micro-batch: the output layer over the rows
        that predict a target, training.loss_chunk_tokens at a time; summed, then divided by
        the step's targets. (On CUDA: one sync per micro-batch, finding the target rows.)"""
        total = head_loss_sum(self.head, hidden, labels, self.setup.training.loss_chunk_tokens)
        self._sums.append(total.detach())
        return total / self._divisor

    def _padded(self, batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        """Pad a batch to `rows` rows of data.max_seq_length tokens (pad rows train nothing)."""
        length = self.setup.max_seq_length
        ids, labels = batch["input_ids"], batch["labels"]
        extra_rows, extra_cols = rows - ids.shape[0], length - ids.shape[1]
        pad = (0, extra_cols, 0, extra_rows)
        return {"input_ids": torch.nn.functional.pad(ids, pad, value=PAD_ID),
                "labels": torch.nn.functional.pad(labels, pad, value=IGNORE_INDEX)}

    def make_loss(self, build):
        """None: the last stage computes the loss itself (`_loss`, inside the schedule)."""
        return None

    def forward_backward(self, step, batch: dict[str, torch.Tensor], divisor, amp,
                         last_micro_batch: bool) -> torch.Tensor:
        """One training micro-batch through the pipeline schedule (the run's `step` is not
        used: the schedule runs the stages' forwards and backwards); its summed loss (0 off
        the last stage), gradients accumulated on this rank's stages."""
        rows = batch["input_ids"].shape[0]
        schedule = self._schedule(rows)
        batch = self._padded(batch, rows)
        args = (batch["input_ids"],) if 0 in self.ids else ()
        target = batch["labels"] if self.head is not None else None
        self._sums, self._divisor = [], divisor
        with torch.autocast(self.d.device.type, dtype=amp, enabled=amp is not None):
            schedule.step(*args, target=target)
        self._count_activations(rows, train=True)
        if self.setup.distributed.pipeline.debug_pipeline:
            # debug only: reads each pipeline micro-batch's loss off the device
            losses = (", summed losses " + " ".join(
                f"{float(x):.4f}" for x in self._sums[-self.n_micro:])
                if self.head is not None else "")
            say(f"[pipeline rank {self.d.rank}] micro-batch of {rows} rows, {self.n_micro} "
                f"pipeline micro-batches of {rows // self.n_micro}: "
                f"{' '.join(self._actions)}{losses}")
            self._actions.clear()
        # the schedule's first step infers the stages' shapes with a forward of its own: its
        # loss is not this batch's
        return self._summed(self._sums[-self.n_micro:])

    def _summed(self, sums: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(sums).sum() if sums else torch.zeros(
            (), dtype=torch.float32, device=self.d.device)

    def _forward_only(self, batch: dict[str, torch.Tensor], amp) -> torch.Tensor:
        """A whole batch through the stages in order, activations sent point to point (the
        runtime schedules keep backward actions even in eval, which the zero-bubble ones
        cannot skip); the summed loss on the last stage's rank, 0 elsewhere."""
        shape = (*batch["input_ids"].shape, self.hidden)
        modules = dict(zip(self.ids, self.stage_modules))
        hidden, sums = None, []
        for s in range(self.num_stages):
            if self.rank_of[s] != self.d.rank:
                continue
            if s == 0:
                hidden = batch["input_ids"]
            elif self.rank_of[s - 1] != self.d.rank:
                hidden = torch.empty(shape, dtype=self.act_dtype, device=self.d.device)
                dist.recv(hidden, src=self.rank_of[s - 1])
            with torch.autocast(self.d.device.type, dtype=amp, enabled=amp is not None):
                hidden = modules[s](hidden)
            if s + 1 < self.num_stages and self.rank_of[s + 1] != self.d.rank:
                dist.send(hidden.to(self.act_dtype).contiguous(), dst=self.rank_of[s + 1])
            if s == self.num_stages - 1:
                self._divisor, self._sums = 1.0, []
                self._loss(hidden, batch["labels"])
                sums = self._sums
        return self._summed(sums)

    def _count_activations(self, rows: int, train: bool) -> None:
        """Bytes this rank sends: activations to the next stage (forward) and their
        gradients to the previous one (backward), where those stages are on another rank."""
        per_micro = (rows // self.n_micro) * self.setup.max_seq_length * self.hidden
        size = per_micro * self.act_dtype.itemsize
        for s in self.ids:
            if s + 1 < self.num_stages and self.rank_of[s + 1] != self.d.rank:
                self.meter.add_bytes("pp_activations", size * self.n_micro)
            if train and s > 0 and self.rank_of[s - 1] != self.d.rank:
                self.meter.add_bytes("pp_activation_grads", size * self.n_micro)

    def loss_divisor(self, local_targets: int, step: int) -> float | torch.Tensor:
        """The step's target count: a pipeline's whole batch is on each of its ranks; the
        replicas' batches are added up (their gradients are summed, not averaged), on the
        device."""
        if self.replicas == 1:
            return float(local_targets)
        return all_reduce_count(local_targets, self.meter, "loss_normaliser", self.d.device,
                                group=self.dp_group, on_device=True).float()

    def before_optimizer_step(self, step: int) -> None:
        """Pipeline x data parallel: each stage's gradients summed over its replicas."""
        if self.replicas == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:  # a stage parameter without a gradient still takes the replicas'
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_flat([p.grad for p in params], self.meter, "pp_dp_grad_all_reduce",
                        group=self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm over this pipeline's stages (each rank holds different
        parameters; the replicas hold the same gradients by now)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        local = (torch.nn.utils.get_total_norm([p.grad for p in params]) if params
                 else torch.zeros((), device=self.d.device))
        squared = (local.double() ** 2).reshape(1)
        all_reduce(squared, self.meter, "pp_grad_norm", group=self.pp_group)
        total = squared.sqrt().squeeze().float()
        if params and math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # -- checkpoint ----------------------------------------------------------------------
    # Each rank's optimizer has its own param groups over other parameters: keyed by group
    # index they would collide in DCP (rank 0's group 0 is not rank 1's), keyed by parameter
    # name (torch's flattened optimizer state dict, as torchtitan does for PP) they cannot.
    FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

    def dcp_state(self, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=self.FLAT)
        names = self.trainable_names()
        return {"model": {k: v for k, v in model_sd.items() if k in names}, "optim": optim_sd}

    def load_dcp_state(self, optimizer, state: dict) -> None:
        set_state_dict(self.module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False, flatten_optimizer_state_dict=True))

    # -- evaluation and export -----------------------------------------------------------
    @torch.no_grad()
    def evaluate_loss(self, dataset, batch_size: int, pad_id: int, max_batches: int | None,
                      amp, loss_sum_fn=None, collate_fn=None) -> dict:
        """Every rank runs every eval batch through the pipeline (forward only); the last
        stage's summed loss and target count are shared. `collate_fn` builds the rows before
        the stages' fixed-width padding (None: dynamic padding)."""
        self.module.eval()
        starts = list(range(0, len(dataset), batch_size))[:max_batches or None]
        starts = starts[self.d.rank // self.pipe::self.replicas]  # each replica its share
        loss_sum, tokens = 0.0, 0
        with self.meter.pause():
            for start in starts:
                rows = take_rows(dataset, range(start, min(start + batch_size, len(dataset))))
                batch = collate_fn(rows) if collate_fn else collate(rows, pad_id)
                padded = {k: v.to(self.d.device) for k, v in
                          self._padded(batch, batch_size).items()}
                loss_sum += float(self._forward_only(padded, amp))
                if self.head is not None:
                    tokens += count_targets(batch)
        loss_sum, tokens = all_reduce_sum(loss_sum, self.d), int(all_reduce_sum(tokens, self.d))
        self.module.train()
        loss = loss_sum / max(tokens, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}

    @property
    def _peft(self) -> bool:
        return hasattr(self.module, "peft_config")

    def full_state_dict(self) -> dict:
        """Collective: the stages' state dicts merged for the main rank's export; for an
        adapter, each stage's adapter weights as PEFT saves them (PEFT's own conversion: it
        keeps only the modules a model has, so each rank converts its own)."""
        if self._peft:
            from peft import get_peft_model_state_dict

            mine = get_peft_model_state_dict(self.module)
        else:
            mine = self.module.state_dict()
        mine = {k: v.detach().cpu() for k, v in mine.items()}
        gathered: list = [None] * self.d.world_size
        dist.all_gather_object(gathered, mine)
        merged: dict = {}
        for part in gathered:
            merged.update(part)
        return merged

    def save_pretrained(self, folder, full: dict) -> None:
        """PEFT writes the config and this stage's weights; the file then gets every
        stage's adapter weights."""
        if not self._peft:
            self.module.save_pretrained(folder, state_dict=full, safe_serialization=True)
            return
        from safetensors.torch import save_file

        self.module.save_pretrained(folder, safe_serialization=True)
        save_file({k: v.contiguous() for k, v in full.items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
