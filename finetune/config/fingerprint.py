"""Which config keys decide a run's trajectory: the config part of a checkpoint's fingerprint.

The rest of the fingerprint (content hashes of the train data and the base model) and the
resume decision are the engine's (engine.fingerprint, engine.trainer_state); which keys count
is a fact about the config, so the schema can check `checkpoint.resume_ignore_changes` here.
"""

from __future__ import annotations

from typing import Any

from finetune.config.section import flatten

#: dotted prefixes left out of the config part of the fingerprint (README: reliability)
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
    "training.loss_chunk_tokens", "training.pad_to_multiple_of", "training.sdpa_",
    "training.construct_model_on",
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
