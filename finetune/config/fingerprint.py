"""Which config keys decide a run's trajectory: the config part of a checkpoint's fingerprint.

The rest of the fingerprint (content hashes of the train data and the base model) and the
resume decision are the engine's (engine.state.fingerprint, engine.state.trainer_state); which keys
count is a fact about the config, so the schema can check `checkpoint.resume_ignore_changes` here.
"""

from __future__ import annotations

from typing import Any

from finetune.config.section import flatten

#: dotted prefixes left out of the config part of the fingerprint (docs/reliability.md)
NOT_IN_FINGERPRINT = (
    # bookkeeping: when to log, save, evaluate, what to export and register
    "logging", "checkpoint", "eval", "export", "registry",
    # the train examples are identified by their content hash; the packed row length is kept
    "data.",
    # the base model is identified by its content hash; loading switches do not change math
    "model.name_or_path", "model.revision", "model.device_map", "model.use_cache",
    "model.trust_remote_code", "model.attn_implementation",
    # speed and memory levers with the same math
    "training.per_device_eval_batch_size", "training.dataloader_", "training.torch_compile",
    "training.gradient_checkpointing", "training.detect_anomaly", "training.varlen_kernel",
    "training.loss_chunk_tokens", "training.use_liger_kernel", "training.pad_to_multiple_of",
    "training.sdpa_",
    "training.construct_model_on", "training.enable_activation_offloading",
    "training.gc_threshold",
    # what is measured and printed, not what is trained
    "training.speed_metrics_start_step",
    "optimizer.log_param_groups",
    # launcher plumbing; the world size and the strategy that runs are recorded as such
    "distributed.nproc_per_node", "distributed.nnodes", "distributed.node_rank",
    "distributed.rdzv_", "distributed.backend", "distributed.threads_per_process",
    "distributed.bucket_cap_mb", "distributed.find_unused_parameters",
    "distributed.gradient_as_bucket_view", "distributed.static_graph",
    "distributed.broadcast_buffers", "distributed.init_sync", "distributed.ddp_timeout",
    "distributed.fsdp.shard_modules", "distributed.fsdp.reshard_after_forward",
    "distributed.fsdp.cpu_offload",
)
#: kept although under a left-out prefix
KEPT = ("data.max_seq_length",)
#: the keys that decide a run's trajectory, each named: a new key must be put here or in
#: NOT_IN_FINGERPRINT (tests/test_key_lists.py), so no key decides resumes by default
IN_FINGERPRINT = (
    "model.auto_class_name", "model.model_init", "model.tokenizer_name_or_path",
    "model.added_tokens", "model.special_tokens", "model.dtype", "model.load_in_4bit",
    "model.load_in_8bit", "peft.use_peft", "peft.peft_type", "peft.r", "peft.lora_alpha",
    "peft.lora_dropout", "peft.target_modules", "peft.feedforward_modules", "peft.bias",
    "peft.task_type", "data.max_seq_length", "training.per_device_train_batch_size",
    "training.gradient_accumulation_steps", "training.global_batch_size",
    "training.num_train_epochs", "training.max_steps", "training.epoch_train_steps",
    "training.group_by_length", "training.length_column_name", "training.packing",
    "training.padding_free", "training.packed_sequence_length", "training.max_grad_norm",
    "training.compute_loss_func", "training.type", "training.device", "training.use_cpu",
    "training.fp8_recipe", "training.fp8_dim_alignment", "training.qat_recipe",
    "training.qat_group_size", "training.fuse_optim_with_backward",
    "training.mixed_precision", "training.seed", "training.full_determinism",
    "training.dynamo_recompile_limit", "training.activation_memory_budget",
    "training.default_dtype", "training.float32_matmul_precision", "optimizer.name",
    "optimizer.learning_rate", "optimizer.weight_decay", "optimizer.kwargs",
    "dpo.beta", "dpo.loss_type", "dpo.label_smoothing", "dpo.simpo_gamma",
    "dpo.precompute_ref_log_probs",
    "optimizer.optimizer_groups", "scheduler.name", "scheduler.warmup_steps",
    "scheduler.warmup_ratio", "scheduler.kwargs", "distributed.strategy",
    "distributed.skip_all_reduce_unused_params", "distributed.fsdp.shard_transformer_layers",
    "distributed.fsdp.param_dtype", "distributed.fsdp.reduce_dtype",
    "distributed.fsdp.buffer_dtype", "distributed.diloco.inner_steps",
    "distributed.diloco.diloco_loops", "distributed.diloco.outer_optimizer",
    "distributed.diloco.outer_lr", "distributed.diloco.outer_momentum",
    "distributed.diloco.outer_nesterov", "distributed.diloco.outer_kwargs",
    "distributed.diloco.outer_lr_schedule", "distributed.diloco.outer_grad_clip",
    "distributed.diloco.fsdp_group_size", "distributed.diloco.local_sgd_start_step",
    "distributed.diloco.post_local_gradient_allreduce", "distributed.pipeline.schedule",
    "distributed.pipeline.n_microbatches", "distributed.pipeline.stages_per_rank",
    "distributed.pipeline.pp_stage_type", "distributed.pipeline.data_parallel_size",
)


def counts(key: str) -> bool:
    """Is this dotted config key part of the fingerprint? A prefix ending in '.' or '_' takes
    every key it starts; another takes itself and its '.'/'_' continuations."""
    if key in KEPT:
        return True
    for prefix in NOT_IN_FINGERPRINT:
        rest = key[len(prefix):len(prefix) + 1] if key.startswith(prefix) else None
        if rest is not None and (prefix[-1] in "._" or rest in ("", ".", "_")):
            return False
    return True


def config_part(cfg: Any) -> dict[str, Any]:
    """`cfg`: a FinetuneConfig (not imported: the schema imports this module)."""
    flat = flatten(cfg.model_dump(mode="json"))
    part = {k: v for k, v in flat.items() if counts(k)}
    part["distributed.world_size"] = cfg.distributed.world_size
    part["distributed.strategy"] = cfg.distributed.resolved_strategy
    return part


#: the content-hash parts of the fingerprint, named like config keys in refusals
CONTENT_KEYS = ("train_data", "base_model")
