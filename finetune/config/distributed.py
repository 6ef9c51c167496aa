"""The `distributed` section: how torchrun launches the worker and how the model is parallelised.

Strategy-specific options live in their own sub-section (`fsdp`, `diloco`, `pipeline`), and the
SLURM launcher's in `slurm`; setting one for a different strategy or launcher is an error,
because it would silently do nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from finetune.config import compat
from finetune.config.pipeline import PipelineConfig
from finetune.config.slurm import SlurmConfig
from finetune.config.section import Field, Section, did_you_mean

FloatDtype = Literal["float32", "bfloat16", "float16"]


#: torch.optim's optimizer classes as of torch 2.13: validating these needs no torch import
#: (~1 s of every `finetune` command); any other name is looked up in the installed torch
TORCH_OPTIMIZERS = frozenset({
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam"})


def torch_optimizer_name(name: str) -> str:
    """A torch.optim class name, or 'module:Class' (checked when the stage loads it);
    'torch.optim:SGD' and 'torch.optim.sgd:SGD' are SGD (one name, one fingerprint)."""
    module, _, attr = name.partition(":")
    if module == "torch.optim" or module.startswith("torch.optim."):
        name = _torch_optim_name(module, attr) or name  # torch.optim.sgd:SGD is SGD too
    if ":" in name:
        return name
    if name in TORCH_OPTIMIZERS:
        return name
    import torch.optim

    klass = getattr(torch.optim, name, None)
    if not (isinstance(klass, type) and issubclass(klass, torch.optim.Optimizer)):
        raise ValueError(f"'{name}' is not a torch.optim optimizer class"
                         f"{did_you_mean(name, TORCH_OPTIMIZERS)} (e.g. AdamW, SGD)")
    return name


def _torch_optim_name(module: str, attr: str) -> str | None:
    """The torch.optim name of the class a 'torch.optim....:Class' reference names, or None
    (then the reference stays as written and the stage loads it)."""
    import importlib

    import torch.optim

    try:
        klass = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None
    return attr if klass is not None and getattr(torch.optim, attr, None) is klass else None


class FsdpConfig(Section):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) options."""

    shard_modules: list[str] | None = Field(
        None, fingerprint=False,
        description="Dotted paths of modules to shard one by one (a ModuleList path shards "
        "each child); default: every transformer block (the model's _no_split_modules).",
    )
    shard_transformer_layers: bool = Field(
        True, fingerprint=True,
        description="Each transformer block (or shard_modules entry) is its own FSDP unit, "
        "gathered only while it runs; false: the root alone (Forgather's root-only wrapping: "
        "one all-gather of every parameter per forward, fewer and larger collectives).",
    )
    reshard_after_forward: bool | int = Field(
        True, fingerprint=False,
        description="Free gathered params after forward (true), keep them (false), or reshard "
        "to a smaller group of this size.",
    )
    param_dtype: FloatDtype | None = Field(
        None, fingerprint=True, description="MixedPrecisionPolicy param dtype.")
    reduce_dtype: FloatDtype | None = Field(
        None, fingerprint=True, description="Gradient reduce-scatter dtype.")
    buffer_dtype: FloatDtype | None = Field(
        None, fingerprint=True,
        description="Cast floating buffers (e.g. rotary tables) to this dtype before sharding."
    )
    cpu_offload: bool = Field(
        False, fingerprint=False, description="Keep sharded params/grads/optimizer on CPU.")

    @model_validator(mode="after")
    def _compat(self) -> "FsdpConfig":
        compat.check(self, "distributed.fsdp")
        return self


class DilocoConfig(Section):
    """DiLoCo: `inner_steps` (H) local steps per outer loop, then one sync.

    Each worker trains alone for H = inner_steps steps with the `optimizer` section (the
    inner optimizer); then the token-weighted mean of (global - local) is the pseudo-gradient
    that the outer optimizer applies to the global parameters. Only trainable parameters are
    synchronised (LoRA: the adapter). Outer SGD with lr 1 and no momentum is plain model
    averaging, i.e. (post-)local SGD.
    """

    inner_steps: int = Field(
        ..., gt=0, fingerprint=True,
        description="H: local optimizer steps per outer loop (required); a worker "
        "trains inner_steps x diloco_loops steps, which training.max_steps may repeat.")
    diloco_loops: int = Field(
        1, fingerprint=True, gt=0, description="Outer loops (syncs); total steps = H x loops.")
    outer_optimizer: str = Field(
        "SGD", fingerprint=True,
        description="The outer step's optimizer: a torch.optim class name, or "
        "'module:Class' (an Optimizer subclass), as optimizer.name; outer_momentum and "
        "outer_nesterov apply to SGD, outer_kwargs to any.")
    outer_lr: float = Field(0.7, fingerprint=True, gt=0, description="Outer learning rate.")
    outer_momentum: float = Field(
        0.9, fingerprint=True, ge=0, lt=1, description="Outer momentum (SGD).")
    outer_nesterov: bool = Field(
        True, fingerprint=True, description="Nesterov outer momentum (SGD).")
    outer_kwargs: dict[str, Any] = Field(
        fingerprint=True, default_factory=dict, description="Extra outer-optimizer kwargs."
    )
    outer_lr_schedule: Literal["none", "cosine", "linear", "polynomial"] = Field(
        "none", fingerprint=True,
        description="Outer lr over the outer loops (transformers schedules)."
    )
    outer_grad_clip: float | None = Field(
        None, fingerprint=True, gt=0, description="Clip the pseudo-gradient's global norm to this."
    )
    fsdp_group_size: int = Field(
        1, fingerprint=True,
        gt=0,
        description="Processes per DiLoCo worker; > 1 shards each worker's model with FSDP2 "
        "over its group (OpenDiLoCo's layout; distributed.fsdp options apply).",
    )
    local_sgd_start_step: int = Field(
        0, fingerprint=True,
        ge=0,
        description="Post-local SGD: average gradients every step (as DDP) before this step, "
        "go local after it.",
    )
    post_local_gradient_allreduce: bool = Field(
        False, fingerprint=True,
        description="In the local phase, still average gradients every step within each "
        "node (torch's PostLocalSGDState: hierarchical SGD, the cheap intra-node links every "
        "step, the slow inter-node ones once per inner_steps); on one node that is every "
        "step over all ranks, i.e. DDP. Needs fsdp_group_size 1.",
    )

    @model_validator(mode="after")
    def _compat(self) -> "DilocoConfig":
        compat.check(self, "distributed.diloco")
        return self

    @field_validator("outer_optimizer")
    @classmethod
    def _known_optimizer(cls, name: str) -> str:
        return torch_optimizer_name(name)

    def outer_optimizer_kwargs(self, klass: type) -> dict[str, Any]:
        """The outer optimizer's kwargs for its class `klass` (what outer_optimizer loads):
        outer_momentum and outer_nesterov go to SGD and its subclasses however the class is
        named; set for another class, they are refused (it has no such arguments)."""
        import torch.optim

        from finetune.errors import PipelineError

        kwargs: dict[str, Any] = {"lr": self.outer_lr}
        if issubclass(klass, torch.optim.SGD):
            kwargs.update(momentum=self.outer_momentum,
                          nesterov=self.outer_nesterov and self.outer_momentum > 0)
        else:
            named = sorted({"outer_momentum", "outer_nesterov"} & self.model_fields_set)
            if named:
                raise PipelineError(
                    f"distributed.diloco.{named[0]} applies to SGD, and outer_optimizer "
                    f"'{self.outer_optimizer}' is {klass.__name__}; remove it or pass the "
                    "class's own arguments in outer_kwargs")
        return {**kwargs, **self.outer_kwargs}


class DistributedConfig(Section):
    """How torchrun launches the worker and how the model is parallelised."""

    strategy: Literal["single", "ddp", "fsdp2", "diloco", "pipeline"] = Field(
        "single", fingerprint=True,
        description="Parallelism strategy (pipeline: the decoder layers split into "
        "stages over the ranks, distributed.pipeline)."
    )
    launcher: Literal["local", "slurm"] = Field(
        "local", fingerprint=False,
        description="How the train stage starts torchrun: here (local; other nodes by hand "
        "with node_rank), or as a SLURM batch job on the cluster's nodes (slurm, options in "
        "distributed.slurm), which the stage submits and follows to its end.")
    nproc_per_node: int = Field(
        1, fingerprint=False, gt=0, description="Processes per node (torchrun).")
    nnodes: int = Field(1, fingerprint=False, gt=0, description="Number of nodes (torchrun).")
    node_rank: int = Field(
        0, fingerprint=False, ge=0, description="This node's rank when nnodes > 1.")
    rdzv_backend: Literal["c10d", "static"] = Field(
        "c10d", fingerprint=False, description="torchrun rendezvous.")
    rdzv_endpoint: str = Field(
        "127.0.0.1:29400", fingerprint=False, description="host:port of the rendezvous.")
    rdzv_id: str = Field(
        "finetune", fingerprint=False, description="Rendezvous id shared by all nodes of a job.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", fingerprint=False,
        description="Process-group backend; auto = nccl on CUDA, gloo on CPU."
    )
    threads_per_process: int | None = Field(
        None, gt=0, fingerprint=False,
        description="torch threads per rank (default: cores / nproc_per_node)."
    )
    ddp_timeout: int = Field(
        1800, fingerprint=False, gt=0,
        description="Seconds a collective waits for the other ranks before the run fails "
        "(HF's ddp_timeout; init_process_group timeout).",
    )
    rdzv_timeout: int = Field(
        600, fingerprint=False, gt=0,
        description="Seconds torchrun waits for all nodes to join the rendezvous (join_timeout).",
    )
    bucket_cap_mb: float = Field(
        25, fingerprint=False, gt=0, description="DDP gradient bucket size.")
    find_unused_parameters: bool = Field(
        False, fingerprint=False, description="DDP: tolerate unused params.")
    gradient_as_bucket_view: bool = Field(
        True, fingerprint=False, description="DDP: grads alias the buckets.")
    static_graph: bool = Field(
        False, fingerprint=False, description="DDP: graph does not change across steps.")
    broadcast_buffers: bool = Field(
        True, fingerprint=False, description="DDP: sync buffers every forward.")
    init_sync: bool = Field(
        True, fingerprint=False, description="DDP: broadcast rank 0's weights at start.")
    skip_all_reduce_unused_params: bool = Field(
        False, fingerprint=True,
        description="DDP: do not all-reduce the gradients of parameters unused in a step "
        "(needs find_unused_parameters: true).")
    fsdp: FsdpConfig | None = Field(None, description="FSDP2 options (strategy fsdp2 only).")
    diloco: DilocoConfig | None = Field(None, description="DiLoCo options (strategy diloco only).")
    pipeline: PipelineConfig | None = Field(
        None, description="Pipeline options (strategy pipeline only; defaults apply when unset).")
    slurm: SlurmConfig | None = Field(
        None, fingerprint=False,
        description="SLURM job options (launcher slurm only; defaults apply when unset).")

    @model_validator(mode="after")
    def _compat(self) -> "DistributedConfig":
        if self.strategy == "pipeline" and self.pipeline is None:
            self.pipeline = PipelineConfig()  # its defaults apply
        if self.launcher == "slurm" and self.slurm is None:
            self.slurm = SlurmConfig()
        compat.check(self, "distributed")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def resolved_strategy(self) -> str:
        """The strategy that actually runs: DDP and FSDP2 with one process have nothing to
        communicate and run single-device. The worker builds this one, checkpoints record it
        and resume compares it, so one value decides everywhere."""
        if self.strategy in ("ddp", "fsdp2") and self.world_size == 1:
            return "single"
        return self.strategy

    @property
    def shards_with_fsdp(self) -> bool:
        """Does the run shard parameters with FSDP2 (strategy fsdp2, or sharded DiLoCo)?"""
        return self.resolved_strategy == "fsdp2" or (
            self.diloco is not None and self.diloco.fsdp_group_size > 1)
