"""A DeepSpeed config (ds_config JSON) read as this pipeline's keys: `training.deepspeed_config`.

Users bring ZeRO files from Trainer/Accelerate setups. This pipeline shards with FSDP2, not
DeepSpeed, so a file is translated, never half-honoured: each JSON key maps to the key here that
does the same (ZeRO-3 is FSDP2 resharding after forward, ZeRO-1 and ZeRO-2 FSDP2 keeping the
gathered parameters), or, where it only tunes DeepSpeed's own machinery (bucket sizes, prefetch
and persistence thresholds, the fp16 loss scaler's window, its console print), has no effect here
and is listed in one warning line with why; what would change the result and has no equivalent is
refused: one line naming the file and each such key with why. "auto" (DeepSpeed's "take it from
the trainer") leaves the key to the params file. Where the params file sets a mapped key to
another value, the two are named and the file is refused: nothing is silently overridden.
The table is applied to the raw params before validation (`apply`), so every rule of the schema
and the compat table then judges the translated keys, and `finetune validate`/`finetune config`
print it (`describe`).
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY = "training.deepspeed_config"
AUTO = "auto"
_MISSING = object()


@dataclass(frozen=True)
class Row:
    """One JSON key and what it became: our keys and values (none: `note` says why)."""

    json_key: str
    value: Any
    sets: tuple[tuple[str, Any], ...] = ()
    note: str = ""
    no_effect: str = ""  # why a tuning key changes nothing here (the warning line's reason)


class _Refusals:
    """The keys with no equivalent: all of them in the one line (an error stays on one line,
    finetune.errors), each with its value and why, so one edit of the file fixes them all."""

    def __init__(self, where: str):
        self.where, self.parts = where, []

    def add(self, json_key: str, value: Any, why: str) -> None:
        self.parts.append(f"{json_key} {json.dumps(value)} ({why})")

    def raise_any(self) -> None:
        if self.parts:
            raise ValueError(f"{self.where}: no equivalent here for " + "; ".join(self.parts))


def load(source: str | dict, root: Path | None = None) -> tuple[dict, str]:
    """(the DeepSpeed config, how messages name it): a JSON file's path (relative to the
    project) or the mapping itself, as QEfficient writes it inline."""
    if isinstance(source, dict):
        return source, KEY
    path = Path(source)
    if not path.is_absolute():
        from finetune.imports import project_root

        path = (root or project_root()) / path
    if not path.is_file():
        raise ValueError(f"{KEY}: no file {source}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{KEY}: {source} line {exc.lineno}: not valid JSON ({exc.msg})"
                         ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{KEY}: {source}: the top level must be a JSON object")
    return data, source


def rows(ds: dict, where: str) -> list[Row]:
    """The table for one DeepSpeed config; a ValueError lists every key it cannot map."""
    out: list[Row] = []
    refused = _Refusals(where)
    for key, value in ds.items():
        handler = _TOP.get(key)
        if value == AUTO:
            out.append(Row(key, value, note="auto: the params file's value"))
        elif handler is None:
            refused.add(key, value, "not a DeepSpeed setting this pipeline has")
        else:
            handler(key, value, out, refused)
    refused.raise_any()
    return out


def apply(raw: dict, root: Path | None = None) -> dict:
    """The raw params with the DeepSpeed config's keys set (FinetuneConfig's first step)."""
    training = raw.get("training")
    source = training.get("deepspeed_config") if isinstance(training, dict) else None
    if source is None:
        return raw
    if source is False:  # the seeds' documented "off", as HF's deepspeed=None
        merged = copy.deepcopy(raw)
        merged["training"]["deepspeed_config"] = None
        return merged
    if not isinstance(source, (str, dict)):
        raise ValueError(f"{KEY}: {json.dumps(source)} is neither a DeepSpeed JSON file's path "
                         "nor its mapping; false or null turns it off")
    ds, where = load(source, root)
    merged = copy.deepcopy(raw)
    clashes = []
    for row in rows(ds, where):
        for dotted, ours in row.sets:
            current = _lookup(merged, dotted)
            if current is not _MISSING and current != ours and not _same_number(current, ours):
                clashes.append(f"{row.json_key} {json.dumps(row.value)} sets {dotted} "
                               f"{json.dumps(ours)}, the params file {json.dumps(current)}")
            _assign(merged, dotted, ours)
    if clashes:  # all of them in the one line: one edit settles them
        raise ValueError(f"{where} and the params file disagree: {'; '.join(clashes)}; keep "
                         "one of each")
    return merged


def no_effect_line(table: list[Row], where: str) -> str | None:
    """The one warning line: every key with no effect here, grouped by why. `finetune
    validate` (dvc.yaml's first stage) and `finetune config` say it beside the table; the
    later stages, which validate the params again, stay quiet."""
    by_why: dict[str, list[str]] = {}
    for row in table:
        if row.no_effect:
            by_why.setdefault(row.no_effect, []).append(row.json_key)
    if not by_why:
        return None
    parts = [f"{', '.join(keys)} ({why})" for why, keys in by_why.items()]
    return f"{where}: no effect here: " + "; ".join(parts)


def describe(source: str | dict, root: Path | None = None) -> tuple[str, str | None]:
    """The mapping as printed by `finetune validate` and `finetune config`, and the warning
    line for the keys that have no effect here (None: every key has one)."""
    ds, where = load(source, root)
    lines = [f"{where}: DeepSpeed keys as this pipeline's (FSDP2) keys:"]
    table = rows(ds, where)
    for row in table:
        sets = ", ".join(f"{k}: {json.dumps(v)}" for k, v in row.sets) or "-"
        note = f"  ({row.note})" if row.note else ""
        note += "  (no effect: see the warning)" if row.no_effect else ""
        lines.append(f"  {row.json_key}: {json.dumps(row.value)} -> {sets}{note}")
    return "\n".join(lines), no_effect_line(table, where)


def _lookup(raw: dict, dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _assign(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
            and not isinstance(b, bool) and float(a) == float(b))


# -- the handlers: one per top-level JSON key -------------------------------------------------

def _to(ours: str, convert=lambda v: v, note: str = ""):
    """A key whose value is ours as is (or converted)."""
    def handle(key, value, out, refused):
        out.append(Row(key, value, ((ours, convert(value)),), note))
    return handle


def _entries(prefix: str, block: dict, out: list[Row]):
    """(json key, name, value) of each entry of a block, less the "auto" ones: those are
    rows saying the params file's value stands."""
    for sub, v in block.items():
        json_key = f"{prefix}.{sub}"
        if v == AUTO:
            out.append(Row(json_key, v, note="auto: the params file's value"))
        else:
            yield json_key, sub, v


def _clipping(key, value, out, refused):
    # DeepSpeed's 0 is no clipping, our null
    out.append(Row(key, value, (("training.max_grad_norm", value or None),)))


def _precision(name: str):
    def handle(key, value, out, refused):
        if not isinstance(value, dict):
            refused.add(key, value, 'write it as {"enabled": true}')
            return
        for json_key, sub, v in _entries(key, value, out):
            if sub == "enabled":
                out.append(Row(json_key, v, (("training.mixed_precision", name),) if v else (),
                               "" if v else "off: the params file's mixed_precision"))
            elif name == "fp16" and sub == "loss_scale" and v == 0:
                out.append(Row(json_key, v, note="dynamic loss scaling: torch's GradScaler"))
            elif name == "fp16" and sub in _SCALER_TUNING:
                out.append(Row(json_key, v, no_effect=_SCALER_WHY))
            elif name == "fp16" and sub == "auto_cast" and v is False:
                out.append(Row(json_key, v, note="inputs are not cast; autocast casts per op"))
            else:
                refused.add(json_key, v, "a static loss scale (fp16.loss_scale > 0) has no "
                            "equivalent here: torch's GradScaler is dynamic" if sub ==
                            "loss_scale" else f"{name} has no such setting here")
    return handle


#: the fp16 dynamic loss scaler's settings: DeepSpeed's scaler, not torch's GradScaler
_SCALER_TUNING = ("loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale",
                  "consecutive_hysteresis")
_SCALER_WHY = ("fp16's loss scaler here is torch's GradScaler: it starts at 2^16, doubles after "
               "2000 steps without overflow and halves at each overflow, skipping that step; "
               "a step without overflow is the same update")
#: ZeRO stages as FSDP2: stage 3 reshards the parameters after forward, stages 1 and 2 keep
#: them gathered between forward and backward (FSDP2 shards optimizer state and gradients
#: together, so stage 1 gets stage 2's memory: the same updates)
_STAGES = {0: (("distributed.strategy", "ddp"),),
           1: (("distributed.strategy", "fsdp2"),
               ("distributed.fsdp.reshard_after_forward", False)),
           2: (("distributed.strategy", "fsdp2"),
               ("distributed.fsdp.reshard_after_forward", False)),
           3: (("distributed.strategy", "fsdp2"),
               ("distributed.fsdp.reshard_after_forward", True))}
#: what FSDP2 always does; false would change only DeepSpeed's speed or memory
_BUILT_IN = {"overlap_comm": "FSDP2 prefetches the next unit's all-gather",
             "contiguous_gradients": "FSDP2's gradient shards are contiguous",
             "reduce_scatter": "FSDP2 reduce-scatters gradients",
             "allgather_partitions": "FSDP2 all-gathers each unit's parameters",
             "stage3_gather_16bit_weights_on_model_save":
                 "the export always writes whole weights"}
#: DeepSpeed's bucket, cache and scheduling knobs: how fast, never what is computed
_TUNING = ("allgather_bucket_size", "reduce_bucket_size", "sub_group_size",
           "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
           "stage3_max_live_parameters", "stage3_max_reuse_distance", "prefetch_bucket_size",
           "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
           "round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters",
           "load_from_fp32_weights", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
           "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save",
           "zero_hpz_partition_size", "stage3_module_granularity_threshold",
           "log_trace_cache_warnings")
#: DeepSpeed's deprecated spellings of CPU offload (true: offload_optimizer / offload_param
#: with device cpu)
_OLD_OFFLOAD = ("cpu_offload", "cpu_offload_param")
_TUNING_WHY = ("FSDP2 communicates per unit (each transformer block, "
               "distributed.fsdp.shard_modules), not in byte buckets, and prefetches the next "
               "unit itself")


def _zero(key, value, out, refused):
    if not isinstance(value, dict):
        refused.add(key, value, "write it as an object with a stage")
        return
    for json_key, sub, v in _entries(key, value, out):
        if sub == "stage":
            if v in _STAGES:
                out.append(Row(json_key, v, _STAGES[v], "FSDP2 shards the optimizer state "
                               "with the gradients, as stage 2: the same updates" if v == 1
                               else ""))
            else:
                refused.add(json_key, v, "stages are 0, 1, 2 or 3")
        elif sub in ("offload_optimizer", "offload_param"):
            _offload(json_key, v, out, refused)
        elif sub in _BUILT_IN:
            if v is True:
                out.append(Row(json_key, v, note=f"always: {_BUILT_IN[sub]}"))
            else:
                out.append(Row(json_key, v, no_effect=f"{_BUILT_IN[sub]}, always; only "
                               "speed depends on it"))
        elif sub in _TUNING:
            out.append(Row(json_key, v, no_effect=_TUNING_WHY))
        elif sub in _OLD_OFFLOAD:  # the deprecated spelling of {"device": "cpu"}
            _offload(json_key, {"device": "cpu" if v is True else "none"}, out, refused)
        elif sub == "cpu_offload_use_pin_memory" and v is True:
            out.append(Row(json_key, v, note="always: FSDP2's CPU offload pins its memory"))
        else:
            refused.add(json_key, v, "ZeRO++ quantizes what is communicated, which changes the "
                        "result" if sub.startswith("zero_quantized") else
                        "not a ZeRO setting this pipeline has")


def _offload(key, value, out, refused):
    if not isinstance(value, dict):
        refused.add(key, value, 'write it as {"device": "cpu"}')
        return
    for json_key, sub, v in _entries(key, value, out):
        if sub == "device" and v == "cpu":
            out.append(Row(json_key, v, (("distributed.fsdp.cpu_offload", True),),
                           "FSDP2 keeps parameters, gradients and the optimizer step on the "
                           "CPU together"))
        elif sub == "device" and v == "none":
            out.append(Row(json_key, v, note="no offload"))
        elif sub == "pin_memory" and v is True:
            out.append(Row(json_key, v, note="always: FSDP2's CPU offload pins its memory"))
        else:
            refused.add(json_key, v, "FSDP2 offloads to pinned CPU memory only "
                        '(distributed.fsdp.cpu_offload); use "device": "cpu"')


#: optimizer params that name our own keys (the rest go to optimizer.kwargs when the class
#: takes them)
_OPTIMIZER_KEYS = {"lr": "optimizer.learning_rate", "weight_decay": "optimizer.weight_decay"}


def _optimizer(key, value, out, refused):
    import torch.optim

    if not isinstance(value, dict) or "type" not in value:
        refused.add(key, value, 'write it as {"type": ..., "params": {...}}')
        return
    params = value.get("params") or {}
    kind = value["type"]
    name, note = kind, ""
    if isinstance(kind, str) and kind.lower() == "adamw":
        name = "AdamW"
    elif isinstance(kind, str) and kind.lower() == "adam":  # decoupled weight decay unless...
        name = "AdamW" if params.get("adam_w_mode", True) else "Adam"
        note = "DeepSpeed's Adam is AdamW unless adam_w_mode is false"
    klass = getattr(torch.optim, name, None) if isinstance(name, str) else None
    if not (isinstance(klass, type) and issubclass(klass, torch.optim.Optimizer)):
        refused.add(f"{key}.type", kind, "DeepSpeed's own optimizer; use Adam, AdamW or a "
                    "torch.optim class name")
        return
    out.append(Row(f"{key}.type", kind, (("optimizer.name", name),), note))
    accepted = set(inspect.signature(klass).parameters)
    for json_key, sub, v in _entries(f"{key}.params", params, out):
        if sub in _OPTIMIZER_KEYS:
            out.append(Row(json_key, v, ((_OPTIMIZER_KEYS[sub], v),)))
        elif sub in ("adam_w_mode", "torch_adam"):
            out.append(Row(json_key, v, note="chooses DeepSpeed's implementation; the torch "
                           f"class here is {name}"))
        elif sub in accepted and sub not in ("params", "lr"):
            out.append(Row(json_key, v, ((f"optimizer.kwargs.{sub}", v),)))
        else:
            refused.add(json_key, v, f"torch.optim.{name} takes no such argument")


#: DeepSpeed's schedules as transformers' ones (linear warmup from 0; DeepSpeed's default
#: warmup is logarithmic, which none of them has)
_SCHEDULES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear",
              "WarmupCosineLR": "cosine_with_min_lr"}


def _scheduler(key, value, out, refused):
    if not isinstance(value, dict) or value.get("type") not in _SCHEDULES:
        kind = value.get("type") if isinstance(value, dict) else value
        refused.add(f"{key}.type", kind, f"the schedules here are {', '.join(_SCHEDULES)}'s "
                    "equivalents (transformers' schedules)")
        return
    kind, params = value["type"], dict(value.get("params") or {})
    out.append(Row(f"{key}.type", kind, (("scheduler.name", _SCHEDULES[kind]),)))
    if "warmup_type" not in params:  # DeepSpeed's default, said in the table
        out.append(Row(f"{key}.params.warmup_type", None, (("scheduler.warmup_type", "log"),),
                       "absent: DeepSpeed's default, log"))
    if kind == "WarmupCosineLR" and "cos_min_ratio" not in params:
        params["cos_min_ratio"] = 0.0001  # DeepSpeed's default, said in the table
    # DeepSpeed's defaults for what the file leaves out (HF fills only "auto" keys): rows, so
    # a params file that says otherwise is named as a disagreement, not silently used
    for sub, default in (("warmup_num_steps", 1000),
                         *((("warmup_max_lr", 0.001),) if kind != "WarmupCosineLR" else ())):
        if sub not in params:
            out.append(Row(f"{key}.params.{sub}", None, (
                ("scheduler.warmup_steps" if sub == "warmup_num_steps"
                 else "optimizer.learning_rate", default),), "absent: DeepSpeed's default"))
    for json_key, sub, v in _entries(f"{key}.params", params, out):
        if sub == "warmup_type":
            if v in ("linear", "log"):
                out.append(Row(json_key, v, (("scheduler.warmup_type", v),)))
            else:
                refused.add(json_key, v, "the warmups here are linear or log")
        elif sub == "warmup_num_steps":
            out.append(Row(json_key, v, (("scheduler.warmup_steps", v),)))
        elif sub == "total_num_steps" and kind != "WarmupLR":
            out.append(Row(json_key, v, (("training.max_steps", v),)))
        elif sub == "warmup_max_lr":
            out.append(Row(json_key, v, (("optimizer.learning_rate", v),)))
        elif sub in ("warmup_min_lr", "warmup_min_ratio") and v == 0:
            out.append(Row(json_key, v, note="the warmups here start at 0"))
        elif sub == "cos_min_ratio" and kind == "WarmupCosineLR":
            out.append(Row(json_key, v, (("scheduler.kwargs.min_lr_rate", v),)))
        elif sub == "last_batch_iteration" and v == -1:
            out.append(Row(json_key, v, note="a fresh schedule; a resume restores its own"))
        else:
            refused.add(json_key, v, f"{_SCHEDULES[kind]} has no such setting")


def _off_only(why: str):
    """A switch of DeepSpeed's own reporting: off is said, on has no effect here."""
    def handle(key, value, out, refused):
        if value is False:
            out.append(Row(key, value, note="off"))
        else:
            out.append(Row(key, value, no_effect=why))
    return handle


_TOP = {
    "train_micro_batch_size_per_gpu": _to("training.per_device_train_batch_size"),
    "gradient_accumulation_steps": _to("training.gradient_accumulation_steps"),
    "train_batch_size": _to("training.global_batch_size"),
    "gradient_clipping": _clipping,
    "steps_per_print": lambda key, value, out, refused: out.append(Row(
        key, value, no_effect="DeepSpeed's own console print; logging.logging_steps sets when "
        "this pipeline logs")),
    "bf16": _precision("bf16"),
    "bfloat16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "zero_optimization": _zero,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "wall_clock_breakdown": _off_only("DeepSpeed's timers; logging.profiler traces the steps"),
    "zero_allow_untested_optimizer": lambda key, value, out, refused: out.append(Row(
        key, value, note="DeepSpeed's check of its own optimizers; FSDP2 takes any")),
    **{name: (lambda key, value, out, refused, why=why: out.append(Row(key, value,
                                                                         no_effect=why)))
       for name, why in {
           "activation_checkpointing": "DeepSpeed's checkpointing API, which transformers' "
           "models never call (HF Trainer ignores it too); training.gradient_checkpointing "
           "is this pipeline's",
           "flops_profiler": "DeepSpeed's profiler; logging.profiler traces the steps here",
           "memory_breakdown": "DeepSpeed's memory report; the train stage logs peak memory",
           "comms_logger": "DeepSpeed's communication log; logging.profiler records it",
           "tensorboard": "DeepSpeed's own monitor; runs are tracked in MLflow",
           "wandb": "DeepSpeed's own monitor; runs are tracked in MLflow",
           "csv_monitor": "DeepSpeed's own monitor; train.csv is written by the train stage",
           "dump_state": "DeepSpeed's start-up print; finetune config prints the resolved "
           "params",
           "zero_force_ds_cpu_optimizer": "DeepSpeed's CPU Adam check; the optimizer here is "
           "torch's",
           "aio": "DeepSpeed's NVMe I/O settings; offload here is to CPU memory",
           "checkpoint": "DeepSpeed's checkpoint-tag handling; checkpoints here are DCP folders",
           "compile": "DeepSpeed's compile switch; training.torch_compile is this pipeline's",
       }.items()},
}
