"""The `distributed.pipeline` section: pipeline parallelism (`distributed.strategy: pipeline`).

torch.distributed.pipelining's schedules by their torch names. The decoder layers are cut into
`stages` contiguous ranges, balanced by parameter count (the embedding with the first stage,
the final norm and the output layer with the last); each rank holds `stages_per_rank` of them,
in a loop (rank r: stages r, r + W, ...) or a V (rank r: r and 2W - 1 - r, what ZBVZeroBubble
needs). Each optimizer step's micro-batch is cut into `n_microbatches` pipeline micro-batches.
With `data_parallel_size` D > 1 the ranks form a (D x W/D) mesh: D pipelines of W/D ranks
each (contiguous ranks, so activations stay between neighbours), each pipeline reading its own
share of the batches, their gradients all-reduced stage by stage (pipeline x data parallel).
Below, W is the ranks of one pipeline.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from finetune.config import compat
from finetune.config.compat import PIPELINE, Agree, Refuse, When, add_rows
from finetune.config.section import Field, Section

#: schedules with one stage per rank; the others run several (PipelineScheduleMulti)
SINGLE_STAGE = ("GPipe", "1F1B")
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


class PipelineConfig(Section):
    """Pipeline parallelism over the decoder layers (strategy pipeline)."""

    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                      "ZBVZeroBubble"] = Field(
        "1F1B", fingerprint=True,
        description="torch.distributed.pipelining schedule, by torch's name.")
    n_microbatches: int | None = Field(
        None, fingerprint=True, gt=0,
        description="Pipeline micro-batches per training micro-batch (None: the number of "
        "stages); per_device_train_batch_size and per_device_eval_batch_size must divide by it.",
    )
    stages_per_rank: int | None = Field(
        None, fingerprint=True, gt=0,
        description="Stages each rank holds (None: 1 for GPipe/1F1B, 2 for the multi-stage "
        "schedules); GPipe and 1F1B need 1, the others at least 2.",
    )
    pp_stage_type: Literal["loop", "v"] | None = Field(
        None, fingerprint=True,
        description="How stages map to ranks: loop (rank r: r, r + W, ...) or v (rank r: r "
        "and 2W - 1 - r; ZBVZeroBubble's layout). None: v for ZBVZeroBubble, else loop.",
    )

    data_parallel_size: int = Field(
        1, fingerprint=True, gt=0,
        description="Pipeline replicas (pipeline x data parallel on a 2-D mesh): the world "
        "size must divide by it and leave >= 2 ranks per pipeline; each replica reads its own "
        "batches (per_device_train_batch_size each) and the replicas' gradients are summed "
        "per stage before the optimizer step.",
    )

    model_splitter: str | None = Field(
        None, fingerprint=True, code_ref=True,
        description="'module:function' that cuts the decoder layers into the stages instead "
        "of the balance by parameter count: called with (the causal LM, the number of "
        "stages), returns one (start, end) layer span per stage, end exclusive, contiguous "
        "from layer 0 to the last (the embedding goes with the first stage, the norm and "
        "output layer with the last); anything else is one line at start-up.",
    )
    debug_split_model: bool = Field(
        False, fingerprint=False,
        description="Rank 0 prints each stage's parts (layers, embedding, norm, output layer), "
        "its parameter count (trainable too) and its rank.")
    debug_pipeline: bool = Field(
        False, fingerprint=False,
        description="Print the schedule's actions per rank and time step once (each "
        "pipeline's first rank), and per training micro-batch its pipeline micro-batches' "
        "summed losses (the last stage's rank; reads them off the device: slower).")
    debug_model_params: bool = Field(
        False, fingerprint=False,
        description="Each rank prints its parameters after placement: name, shape, dtype, "
        "device, trainable.")
    debug_model_init: bool = Field(
        False, fingerprint=False,
        description="Each rank prints what it built: its stages and their layers, "
        "construct_model_on, parameter count, devices and dtypes, trainable count, any still "
        "on meta, whether it holds the output layer.")

    @model_validator(mode="after")
    def _compat(self) -> "PipelineConfig":
        compat.check(self, "distributed.pipeline")
        return self

    @property
    def one_stage_per_rank(self) -> bool:
        """The schedule runs one stage on each rank (GPipe, 1F1B); the others several."""
        return self.schedule in SINGLE_STAGE

    @property
    def zero_bubble(self) -> bool:
        """The schedule splits the backward (input and weight gradients apart)."""
        return self.schedule in ZERO_BUBBLE

    @property
    def resolved_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule in SINGLE_STAGE else 2

    @property
    def resolved_stage_type(self) -> str:
        if self.pp_stage_type is not None:
            return self.pp_stage_type
        return "v" if self.schedule == "ZBVZeroBubble" else "loop"

    def pipeline_ranks(self, world_size: int) -> int:
        """Ranks per pipeline (W above)."""
        return world_size // self.data_parallel_size

    def stages(self, world_size: int) -> int:
        return self.pipeline_ranks(world_size) * self.resolved_stages_per_rank

    def microbatches(self, world_size: int) -> int:
        return self.n_microbatches or self.stages(world_size)


# -- the pipeline's rows of the compatibility table (finetune/config/compat.py), beside it ---

ZERO_BUBBLE_PIPELINE = When(
    "a zero-bubble pipeline schedule", lambda c: c.distributed.strategy == "pipeline"
    and c.distributed.pipeline.zero_bubble)


def _pipeline_batches(c) -> str | None:
    if c.distributed.strategy != "pipeline":
        return None
    n = c.distributed.pipeline.microbatches(c.distributed.world_size)
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(c.training, key) % n:
            return (f"training.{key} {getattr(c.training, key)} does not divide into "
                    f"distributed.pipeline n_microbatches {n}")
    return None


def _pipeline_ranks(d) -> str | None:
    if d.strategy != "pipeline":
        return None
    world = d.world_size
    if world == 1:
        return ("strategy pipeline splits the model over processes; with nproc_per_node x "
                "nnodes = 1 there is nothing to split (use single, or set nproc_per_node >= 2)")
    dp = (d.pipeline.data_parallel_size if d.pipeline else 1)
    if world % dp or world // dp < 2:
        return (f"pipeline.data_parallel_size {dp} must divide the world size {world} and "
                "leave at least 2 ranks per pipeline")
    return None


def _stage_layout(p) -> str | None:
    per_rank, style = p.resolved_stages_per_rank, p.resolved_stage_type
    if p.one_stage_per_rank and per_rank != 1:
        return (f"schedule {p.schedule} runs one stage per rank; stages_per_rank {per_rank} "
                "needs Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble")
    if not p.one_stage_per_rank and per_rank < 2:
        return (f"schedule {p.schedule} runs several stages per rank; set stages_per_rank >= 2 "
                "(or use GPipe / 1F1B)")
    if style == "v" and per_rank != 2:
        return f"pp_stage_type v places exactly 2 stages on each rank (got stages_per_rank {per_rank})"
    if p.schedule == "ZBVZeroBubble" and style != "v":
        return "schedule ZBVZeroBubble needs pp_stage_type v"
    return None


add_rows("distributed.pipeline", [
    Agree("distributed.pipeline", ("schedule", "stages_per_rank", "pp_stage_type"),
          _stage_layout, example={"distributed.strategy": "pipeline",
                                  "distributed.nproc_per_node": 2,
                                  "distributed.pipeline.stages_per_rank": 2}),
    Agree("config", ("training.per_device_train_batch_size", "distributed.pipeline"),
          _pipeline_batches, example={"distributed.strategy": "pipeline",
                                      "distributed.nproc_per_node": 2,
                                      "training.per_device_train_batch_size": 3}),
    *(Refuse("config", key, PIPELINE, why, used=used, example={
        "distributed.strategy": "pipeline", "distributed.nproc_per_node": 2, **extra})
      for key, used, why, extra in (
        ("training.dataloader_drop_last", lambda c: not c.training.dataloader_drop_last,
         "every pipeline step needs whole batches", {"training.dataloader_drop_last": False}),
        ("training.mixed_precision", lambda c: c.training.mixed_precision == "fp16",
         "fp16's loss scaling does not run through the pipeline schedules; use bf16",
         {"training.mixed_precision": "fp16"}),
        ("training.packing", None, "stages pass fixed-shape activations",
         {"training.packing": True}),
        ("training.padding_free", None, "stages pass fixed-shape activations",
         {"training.padding_free": True}),
        ("data.collate_fn", None, "the pipeline pads every batch to data.max_seq_length itself",
         {"data.collate_fn": "m:f"}),
        ("data.streaming", None, "not supported with pipeline stages yet",
         {"data.streaming": True}),
        ("training.compute_loss_func", None, "the last stage computes the loss from the "
         "hidden states in chunks (training.loss_chunk_tokens); a loss of full logits does "
         "not run there", {"training.compute_loss_func": "m:f"}),
        ("training.use_liger_kernel", None, "the last stage computes its own chunked loss; "
         "Liger's fused loss is not wired into the stages", {"training.use_liger_kernel": True}),
        ("training.torch_compile_mode",
         lambda c: c.training.torch_compile and c.training.torch_compile_mode == "max-autotune",
         "max-autotune captures CUDA graphs, which replay stale gradients across a schedule's "
         "micro-batches (as under gradient accumulation); use max-autotune-no-cudagraphs",
         {"training.torch_compile": True, "training.torch_compile_mode": "max-autotune"}),
        ("training.fused_loss_factory", None, "the last stage computes its own chunked "
         "loss; a fused loss is not wired into the stages", {"training.fused_loss_factory": "m:f"}),
    )),
    Refuse("config", "training.torch_compile", ZERO_BUBBLE_PIPELINE,
           "zero-bubble schedules split the backward, which compiled stages cannot",
           example={"distributed.strategy": "pipeline", "distributed.nproc_per_node": 2,
                    "distributed.pipeline.schedule": "ZBVZeroBubble",
                    "training.torch_compile": True}),
])
add_rows("distributed", [
    Agree("distributed", ("strategy", "pipeline.data_parallel_size"), _pipeline_ranks,
          example={"distributed.strategy": "pipeline"}),
])
