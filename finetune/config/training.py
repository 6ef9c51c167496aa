"""Config of the training loop (`training`): batches, precision, compile, kernels, the loss.

Its own module because it is the largest section and the one every engine feature extends.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, field_validator, model_validator

from finetune.config import compat
from finetune.config.section import Field, Section


class GradientCheckpointingKwargs(Section):
    """Passed to torch.utils.checkpoint (via HF's gradient_checkpointing_enable)."""

    use_reentrant: bool = Field(
        False, description="Reentrant autograd checkpointing (legacy; non-reentrant is safer)."
    )
    preserve_rng_state: bool = Field(
        True, description="Replay dropout masks exactly in the recomputation."
    )


class TrainingConfig(Section):
    """The loop's size and cadence (HF TrainingArguments names)."""

    per_device_train_batch_size: int = Field(
        8, fingerprint=True, gt=0, description="Micro-batch per process.")
    per_device_eval_batch_size: int = Field(
        16, fingerprint=False, gt=0, description="Eval batch per process.")
    gradient_accumulation_steps: int = Field(
        1, fingerprint=True, gt=0, description="Micro-batches per step.")
    global_batch_size: int | None = Field(
        None, gt=0, fingerprint=True,
        description="Optional check: must equal micro x accumulation x world size."
    )
    num_train_epochs: float = Field(
        1.0, fingerprint=True, ge=0, description="Epochs (ignored when max_steps > 0).")
    max_steps: int = Field(
        -1, fingerprint=True,
        description="Optimizer steps; > 0 wins over num_train_epochs; -1 (or 0): unset, "
        "num_train_epochs decides. Other negative values are refused.")
    epoch_train_steps: int | None = Field(
        None, fingerprint=True, gt=0,
        description="A streamed train split's nominal epoch, in optimizer steps (Forgather's): "
        "after this many steps the stream starts over, reshuffled (data.seed + epoch), so "
        "epoch save/eval/logging strategies and num_train_epochs work on streams (an epoch "
        "the stream runs out of first ends there). Streaming only: a stored split knows its "
        "length.",
    )
    group_by_length: bool = Field(
        False, fingerprint=True,
        description="Batch examples of similar length together (less padding)."
    )
    length_column_name: str = Field(
        "length", fingerprint=True,
        description="group_by_length: the tokenized split's column of per-example lengths "
        "(HF's name; the tokenize stage writes `length`, the token count; another int column, "
        "e.g. n_trainable, groups by it instead).",
    )
    dataloader_num_workers: int = Field(
        0, ge=0, fingerprint=False,
        description="Worker processes that collate batches (0: in the main process)."
    )
    dataloader_pin_memory: bool = Field(
        True, fingerprint=False,
        description="Pinned host memory for faster copies to the GPU (no-op on CPU)."
    )
    dataloader_prefetch_factor: int | None = Field(
        None, gt=0, fingerprint=False,
        description="Batches each worker prepares ahead (None: torch's 2)."
    )
    dataloader_persistent_workers: bool = Field(
        False, fingerprint=False, description="Keep workers alive between epochs."
    )
    dataloader_drop_last: bool = Field(
        True, fingerprint=False,
        description="Drop the epoch's incomplete last optimizer step; false fills it with "
        "examples from the epoch's start (every example is trained on every epoch).",
    )
    packing: bool = Field(
        False, fingerprint=True,
        validation_alias=AliasChoices("packing", "dynamic_batch"),
        description="Pack each micro-batch's examples into rows of up to "
        "packed_sequence_length tokens, position_ids restarting per example (no attention across examples; no "
        "padding compute). Alias: dynamic_batch.",
    )
    padding_free: bool = Field(
        False, fingerprint=True,
        description="Each micro-batch as one row with no padding at all: position_ids restart "
        "per example and a varlen attention kernel keeps examples apart (training."
        "varlen_kernel), so compute follows the real tokens (TRL's padding_free). Checked by a "
        "probe at start-up. Exclusive with packing.",
    )
    varlen_kernel: Literal["auto", "torch_varlen", "flash_attn", "flex",
                           "sdpa_per_example"] = Field(
        "auto", fingerprint=False,
        description="Attention kernel for padding_free (and packing on a GPU): auto picks the "
        "fastest the machine has (torch's flash varlen on CUDA with bf16/fp16 compute, then the "
        "flash-attn package, then FlexAttention with a document mask, any dtype; on a CPU "
        "causal SDPA per example, torch having no FlexAttention backward there, except that a "
        "bf16/fp16 micro-batch of examples up to 256 tokens runs as one right-padded batch of "
        "matmuls, faster than the CPU flash kernel at those lengths). The choice is printed at "
        "start-up.",
    )
    packed_sequence_length: int | None = Field(
        None, fingerprint=True, gt=0,
        description="Packing: tokens per packed row (None: data.max_seq_length). Positions "
        "restart per example, so this may exceed the model's max_position_embeddings.",
    )
    loss_chunk_tokens: int | None = Field(
        4096, fingerprint=False, gt=0,
        description="Cross entropy without the full fp32 logits: the output layer runs only on "
        "positions that predict a target, this many at a time (one chunk's logits in memory, "
        "forward and backward); equal to the full loss up to summation order. null: the "
        "model's full logits (needed for a model that transforms logits after its output "
        "layer; a start-up probe refuses such a model with one line). A classifier has no "
        "vocabulary head: another value than the default is refused there.",
    )
    use_liger_kernel: bool = Field(
        False, fingerprint=False,
        description="Liger's Triton kernels (HF's name; the liger-kernel package, extra "
        "`liger`): its RMSNorm, RoPE and SwiGLU patched in through Liger's own entry point for "
        "the model family, and its fused linear cross entropy as the loss (the logits never "
        "materialise; it replaces the chunked loss, so loss_chunk_tokens does not apply). A "
        "start-up probe compares loss and gradients with the unpatched model. CUDA only; a "
        "family Liger does not cover is refused with one line.",
    )
    fused_lora: bool = Field(
        True, fingerprint=False,
        description="peft's LoRA linear layers as one autograd node each: the scale and the "
        "adapter's output folded into the GEMMs, forward and backward (no separate elementwise "
        "pass over the layer's output or input gradient; equal to peft's up to float "
        "rounding). Applies to plain LoRA only (one active adapter, no DoRA, no dropout, an "
        "ordinary linear base); other layers and calls run peft's own forward. false: peft's "
        "forward everywhere.",
    )
    pad_to_multiple_of: int | None = Field(
        None, fingerprint=False, gt=0,
        description="Pad each batch's rows to a multiple of this many tokens (HF's name): a "
        "few shapes instead of one per length, so torch.compile graphs, CUDA graphs and the GPU "
        "attention kernels' per-shape plans are reused. Padded and packed rows are padded; a "
        "padding_free row gets a tail of pad tokens (labels ignored, attending only to itself) "
        "up to the next multiple: its token buckets (e.g. 512) are what compile with dynamic: "
        "false wants. Packing with the packed length here gives every row one width.",
    )
    sdpa_backend: list[Literal["flash_attention", "efficient_attention", "cudnn_attention",
                               "math"]] | None = Field(
        None, fingerprint=False,
        description="SDPA kernels the model's attention may use (torch.nn.attention."
        "sdpa_kernel). None: on CUDA flash, then memory-efficient, then cuDNN, then math, in "
        "that priority (cuDNN plans every new shape on the host, ~3 ms per call on an H100); "
        "on CPU torch's choice. The CPU has flash_attention and math only.",
    )
    sdpa_set_priority: bool = Field(
        True, fingerprint=False,
        description="Try sdpa_backend in the order given (else torch's own order)."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, fingerprint=True,
        description="Gradient clipping norm; null: no clipping (the norm is still "
        "logged, except with fuse_optim_with_backward).")
    fused_loss_factory: str | None = Field(
        None, fingerprint=True, code_ref=True,
        description="'module:function' called once with no arguments that returns your fused "
        "linear cross entropy fn(hidden, weight, labels) -> summed loss: hidden states of the "
        "positions that predict a target, the output layer's weight, their target ids; it "
        "replaces the chunked loss, installed on the output layer as Liger's is, after a "
        "start-up probe against the full cross entropy (loss and gradients).",
    )
    compute_loss_func: str | None = Field(
        None, fingerprint=True, code_ref=True,
        description="'module:function' computing the loss from the model's outputs, called as "
        "HF's Trainer does: fn(outputs, labels, num_items_in_batch). We pass "
        "num_items_in_batch=1 and normalise by the step's target tokens ourselves, so an HF "
        "function (sum / num_items_in_batch) keeps its meaning. Uses the full logits (the "
        "chunked loss does not apply).",
    )
    type: str = Field(
        "sft", fingerprint=True,
        description="Trainer type (QEfficient's name): sft (our loop), dpo (preference tuning on "
        "a preference dataset; the dpo section), grpo (online RL with reward functions on a "
        "prompt dataset; the grpo section), a key a project registered with "
        "engine.recipe.trainers.register_trainer, or 'module:Class' (a TrainingRun subclass).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", fingerprint=True,
        description="Where training runs: auto (a CUDA GPU when one is visible, else the CPU), "
        "cpu (also on a GPU machine), cuda (refused with one line where none is visible).",
    )
    use_cpu: bool = Field(
        False, fingerprint=True, description="HF's name for device: cpu."
    )
    cpu_numerics: Literal["native", "portable"] = Field(
        "native", fingerprint=False,
        description="On a CPU: native lets torch's CPU kernels pick their instructions and "
        "thread count by machine (fastest; bitwise reruns on the same machine only); portable "
        "pins them (ATen AVX2 kernels, MKL's COMPATIBLE branch, oneDNN AVX2, "
        "distributed.threads_per_process or 2 threads), so the same inputs give the same "
        "bytes on any x86-64 CPU with AVX2. Applies to the train, evaluate and export stages; "
        "on a CUDA GPU, or a CPU that cannot (not x86-64 AVX2), it runs native and says so.",
    )
    cpu_malloc_reuse: bool = Field(
        True, fingerprint=False,
        description="The training processes keep freed memory for reuse (glibc malloc: no "
        "mmap for large blocks, no trimming), so the large tensors a step frees are not "
        "page-faulted in again the next step: 1.85x tokens/s in bf16 on a CPU in "
        "bench/peers_cpu.py's 29M model, at a higher resident peak (+607 MB there; the heap "
        "does not shrink). Results are the same either way; false: glibc's defaults.",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = Field(
        None, fingerprint=True,
        description="Train the linear layers in fp8 (torchao Float8Linear, this scaling "
        "recipe): CUDA GPUs of compute capability >= 8.9 only, refused with one line "
        "elsewhere. Not with qat_recipe.",
    )
    fp8_dim_alignment: int = Field(
        16, fingerprint=True, gt=0,
        description="fp8 converts only linear layers whose input and output sizes are "
        "multiples of this (the fp8 GEMMs' requirement); the others are listed and stay.",
    )
    qat_recipe: Literal["int8-dynamic-act-int4-weight", "int4-weight-only",
                        "float8-dynamic-act-float8-weight"] | None = Field(
        None, fingerprint=True,
        description="Quantisation-aware training (torchao): fake-quantised linear layers in "
        "training; the export stage writes the converted model to data/export/quantized and "
        "the evaluate stage reports its loss. Every recipe trains on any device; the "
        "conversion needs torchao's kernels (int8-dynamic-act-int4-weight has them on CPU, "
        "the others need a CUDA GPU): where missing, the evaluate stage skips the quantized "
        "loss, and export.formats with quantized is refused before training. Not with "
        "fp8_recipe.",
    )
    qat_group_size: Literal[32, 64, 128, 256] = Field(
        32, fingerprint=True,
        description="Weights per quantisation group (int4 recipes; the group sizes torchao's "
        "int4 kernels take); layers whose input size it does not divide stay in full "
        "precision and are listed.",
    )
    enable_activation_offloading: bool = Field(
        False, fingerprint=False,
        description="Keep the activations saved for backward in host memory (pinned) instead of "
        "on the GPU (torch.autograd.graph.save_on_cpu); CUDA only: on a CPU they already are.",
    )
    gc_threshold: float | None = Field(
        None, fingerprint=False, gt=0, lt=1,
        description="CUDA caching allocator garbage_collection_threshold: reclaim cached "
        "unused blocks once this fraction of GPU memory is in use (PYTORCH_CUDA_ALLOC_CONF), "
        "instead of freeing all at an out-of-memory. CUDA only.",
    )
    fuse_optim_with_backward: bool = Field(
        False, fingerprint=True,
        description="Update each parameter inside backward as soon as its gradient is ready and "
        "free that gradient (torchtune's optimizer-in-backward): a step never holds all "
        "gradients. Needs max_grad_norm: null, gradient_accumulation_steps 1, no fp16 and "
        "strategy single (Forgather's rules).",
    )
    construct_model_on: Literal["default", "device", "meta"] = Field(
        "default", fingerprint=False,
        description="Where the base model is built. default: loaded on the CPU, then moved; "
        "device: loaded straight onto the training device (no host copy of the weights); "
        "meta: built without weights, the strategy keeps this rank's part and only that is "
        "read from the model's safetensors onto the device (pipeline: its stages' tensors; "
        "FSDP2: its shard of each tensor; ddp/single/DiLoCo: all). Same weights and adapter "
        "init in all three.",
    )
    mixed_precision: Literal["bf16", "fp16", "fp32", "no"] = Field(
        "fp32", fingerprint=True,
        description="Autocast dtype; fp32/no = full precision. HF's flags set it too: "
        "bf16: true or fp16: true (false leaves it as it is).",
    )
    deepspeed_config: str | dict[str, Any] | None = Field(
        None, fingerprint=False,
        description="A DeepSpeed config (ds_config JSON file, relative to the project, or the "
        "mapping inline as QEfficient writes it) read as this pipeline's keys: ZeRO-2/3 is "
        "FSDP2, its batch, precision, clipping, optimizer and scheduler blocks the keys that do "
        "the same; a key with no equivalent, or one the params file sets to another value, is "
        "refused. `finetune validate` prints the table (docs/distributed.md).",
    )
    seed: int | None = Field(
        42, fingerprint=True, ge=0, le=2**32 - 1,
        description="Seed for init, dropout and data order. null (or -1, QEfficient's 'do not "
        "seed'): unseeded: the train stage draws one, logs it (MLflow param, train metrics, "
        "checkpoints) and a resume continues with the checkpoint's.",
    )
    full_determinism: bool = Field(
        False, fingerprint=True,
        description="torch.use_deterministic_algorithms + deterministic cuDNN/cuBLAS "
        "(bitwise-repeatable GPU runs, slower)."
    )
    gradient_checkpointing: bool = Field(
        False, fingerprint=False,
        description="Recompute activations in backward (less memory, ~30% more compute)."
    )
    enable_activation_checkpoint_fn: str | None = Field(
        None, fingerprint=False, code_ref=True,
        description="'module:function' choosing which modules recompute their activations "
        "in backward: called with each (module, name) of the base model (or the module "
        "alone, torch's check_fn), returns True or False; the outermost chosen modules are "
        "checkpointed (torch's composable checkpoint: names unchanged). Replaces "
        "gradient_checkpointing's per-block choice; non-reentrant only.",
    )
    gradient_checkpointing_kwargs: GradientCheckpointingKwargs = Field(
        fingerprint=False, default_factory=GradientCheckpointingKwargs,
        description="torch.utils.checkpoint options.",
    )
    torch_compile: bool = Field(
        False, fingerprint=False, description="torch.compile the model for training.")
    torch_compile_scope: Literal["blocks", "model"] = Field(
        "blocks", fingerprint=False,
        description="What torch_compile compiles: each decoder block in place (regional, as "
        "torchtitan does: one block's compile time, hooks of DDP/FSDP2 outside the graphs) or "
        "the whole wrapped model.",
    )
    torch_compile_backend: str = Field(
        "inductor", fingerprint=False, description="torch.compile backend.")
    torch_compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = Field("default", fingerprint=False, description="torch.compile mode.")
    torch_compile_dynamic: bool | None = Field(
        None, fingerprint=False,
        description="Dynamic shapes (None: torch decides after a recompile)."
    )
    torch_compile_fullgraph: bool = Field(
        False, fingerprint=False, description="Fail on graph breaks.")
    dynamo_recompile_limit: int | None = Field(
        None, fingerprint=True, gt=0,
        description="torch._dynamo's recompile_limit: graphs per compiled function before it "
        "runs eager (each new shape or dtype is a recompile). None: torch's default. Needs "
        "torch_compile.",
    )
    activation_memory_budget: float | None = Field(
        None, fingerprint=True, ge=0, le=1,
        description="torch.compile's activation memory budget (torch._functorch.config): 1 "
        "keeps every activation for backward, lower recomputes the cheap ones to fit the "
        "fraction. None: torch's default (1). Needs torch_compile.",
    )
    default_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, fingerprint=True,
        description="torch.set_default_dtype for the run: the dtype of tensors created without "
        "one (the adapter's weights, tensors made at run time). None: torch's float32.",
    )
    speed_metrics_start_step: int = Field(
        0, fingerprint=False, ge=0,
        description="The final train_tokens_per_second / train_steps_per_second count the steps "
        "after this one (warm-up and compile steps excluded); the logged rows' tokens/s are "
        "per window either way.",
    )
    float32_matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest", fingerprint=True,
        description="torch.set_float32_matmul_precision (high: TF32 on Ampere+)."
    )
    detect_anomaly: bool = Field(
        False, fingerprint=False,
        description="autograd anomaly detection: the op that made a NaN (slow; debug)."
    )

    @model_validator(mode="before")
    @classmethod
    def _hf_precision_flags(cls, raw):
        """HF TrainingArguments' `bf16: true` / `fp16: true` are mixed_precision bf16 / fp16,
        so a Trainer user's section works as written; both true, or a flag that disagrees
        with mixed_precision, is refused."""
        if not isinstance(raw, dict) or not {"bf16", "fp16"} & raw.keys():
            return raw
        raw = dict(raw)
        flags = {name: raw.pop(name) for name in ("bf16", "fp16") if name in raw}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name}: true or false (HF's flag for mixed_precision "
                                 f"{name}), got {value!r}")
        on = [name for name, value in flags.items() if value]
        if len(on) > 1:
            raise ValueError("bf16 and fp16 are both true; set one of them (or mixed_precision)")
        if on:
            current = raw.get("mixed_precision")
            if current not in (None, on[0]):
                raise ValueError(f"{on[0]}: true and mixed_precision {current!r} disagree; "
                                 "keep one of them")
            raw["mixed_precision"] = on[0]
        return raw

    @field_validator("max_steps")
    @classmethod
    def _unset_is_minus_one(cls, value: int) -> int:
        """-1 is HF's "unset"; any other negative count was a typo, and read as unset it
        silently trained whole epochs."""
        if value < -1:
            raise ValueError("a number of optimizer steps > 0, or -1 for unset (then "
                             "num_train_epochs decides)")
        return value

    @field_validator("seed", mode="before")
    @classmethod
    def _minus_one_is_unseeded(cls, value):
        """-1 is how QEfficient writes 'do not seed': our null (a drawn, logged seed)."""
        return None if type(value) is int and value == -1 else value

    @model_validator(mode="after")
    def _compat(self) -> "TrainingConfig":
        compat.check(self, "training")  # the rules among these keys (finetune/config/compat.py)
        return self

    @property
    def resolved_device(self) -> str:
        """training.device with use_cpu applied."""
        return "cpu" if self.use_cpu else self.device
