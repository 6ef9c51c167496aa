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
