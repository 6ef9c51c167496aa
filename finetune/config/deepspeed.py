"""A DeepSpeed config (ds_config JSON) read as this pipeline's keys: `training.deepspeed_config`.

Users bring ZeRO files from Trainer/Accelerate setups. This pipeline shards with FSDP2, not
DeepSpeed, so a file is translated, never half-honoured: each JSON key maps to the key here that
does the same (ZeRO-3 is FSDP2 resharding after forward, ZeRO-2 FSDP2 keeping the gathered
parameters), or is refused: one line naming the file and each such key with why. "auto" (DeepSpeed's
"take it from the trainer") leaves the key to the params file. Where the params file sets a mapped
key to another value, the two are named and the file is refused: nothing is silently overridden.
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


def describe(source: str | dict, root: Path | None = None) -> str:
    """The mapping as printed by `finetune validate` and `finetune config`."""
    ds, where = load(source, root)
    lines = [f"{where}: DeepSpeed keys as this pipeline's (FSDP2) keys:"]
    for row in rows(ds, where):
        sets = ", ".join(f"{k}: {json.dumps(v)}" for k, v in row.sets) or "-"
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"  {row.json_key}: {json.dumps(row.value)} -> {sets}{note}")
    return "\n".join(lines)


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
            else:
                refused.add(json_key, v, "the loss scaler here is torch's GradScaler with its "
                            "own settings" if name == "fp16" else "bf16 has no other setting")
    return handle


#: ZeRO stages as FSDP2: stage 3 reshards the parameters after forward, stage 2 keeps them
_STAGES = {0: (("distributed.strategy", "ddp"),),
           2: (("distributed.strategy", "fsdp2"),
               ("distributed.fsdp.reshard_after_forward", False)),
           3: (("distributed.strategy", "fsdp2"),
               ("distributed.fsdp.reshard_after_forward", True))}
#: what FSDP2 always does; false asks for what it cannot turn off
_BUILT_IN = {"overlap_comm": "FSDP2 prefetches the next unit's all-gather",
             "contiguous_gradients": "FSDP2's gradient shards are contiguous",
             "reduce_scatter": "FSDP2 reduce-scatters gradients",
             "allgather_partitions": "FSDP2 all-gathers each unit's parameters",
             "stage3_gather_16bit_weights_on_model_save":
                 "the export always writes whole weights"}
#: DeepSpeed's bucket and cache sizes: FSDP2 communicates per unit (a transformer block)
_NO_EQUIVALENT = ("FSDP2 communicates per unit (each transformer block, "
                  "distributed.fsdp.shard_modules), not in buckets of a size; remove it")


def _zero(key, value, out, refused):
    if not isinstance(value, dict):
        refused.add(key, value, "write it as an object with a stage")
        return
    for json_key, sub, v in _entries(key, value, out):
        if sub == "stage":
            if v in _STAGES:
                out.append(Row(json_key, v, _STAGES[v]))
            else:
                refused.add(json_key, v, "FSDP2 shards gradients with the optimizer state; "
                            "stage 2 is reshard_after_forward false, 3 true" if v == 1
                            else "stages are 0, 2 or 3 here")
        elif sub in ("offload_optimizer", "offload_param"):
            _offload(json_key, v, out, refused)
        elif sub in _BUILT_IN:
            if v is True:
                out.append(Row(json_key, v, note=f"always: {_BUILT_IN[sub]}"))
            else:
                refused.add(json_key, v, f"{_BUILT_IN[sub]}, always")
        else:
            refused.add(json_key, v, _NO_EQUIVALENT)


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
    if params.get("warmup_type", "log") not in ("linear", AUTO):  # DeepSpeed's default: log
        refused.add(f"{key}.params.warmup_type", params.get("warmup_type", "log (DeepSpeed's "
                    "default)"), 'the warmups here are linear; set "warmup_type": "linear"')
    if kind == "WarmupCosineLR" and "cos_min_ratio" not in params:
        params["cos_min_ratio"] = 0.0001  # DeepSpeed's default, said in the table
    for json_key, sub, v in _entries(f"{key}.params", params, out):
        if sub == "warmup_type":  # any other value is refused above
            if v == "linear":
                out.append(Row(json_key, v, note="transformers' warmups are linear"))
        elif sub == "warmup_num_steps":
            out.append(Row(json_key, v, (("scheduler.warmup_steps", v),)))
        elif sub == "total_num_steps" and kind != "WarmupLR":
            out.append(Row(json_key, v, (("training.max_steps", v),)))
        elif sub == "warmup_max_lr":
            out.append(Row(json_key, v, (("optimizer.learning_rate", v),)))
        elif sub in ("warmup_min_lr", "warmup_min_ratio") and v == 0:
            out.append(Row(json_key, v, note="transformers' warmups start at 0"))
        elif sub == "cos_min_ratio" and kind == "WarmupCosineLR":
            out.append(Row(json_key, v, (("scheduler.kwargs.min_lr_rate", v),)))
        elif sub == "last_batch_iteration" and v == -1:
            out.append(Row(json_key, v, note="a fresh schedule; a resume restores its own"))
        else:
            refused.add(json_key, v, f"{_SCHEDULES[kind]} has no such setting")


def _off_only(why: str):
    def handle(key, value, out, refused):
        if value is False:
            out.append(Row(key, value, note="off"))
        else:
            refused.add(key, value, why)
    return handle


_TOP = {
    "train_micro_batch_size_per_gpu": _to("training.per_device_train_batch_size"),
    "gradient_accumulation_steps": _to("training.gradient_accumulation_steps"),
    "train_batch_size": _to("training.global_batch_size"),
    "gradient_clipping": _clipping,
    "steps_per_print": _to("logging.logging_steps"),
    "bf16": _precision("bf16"),
    "bfloat16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "zero_optimization": _zero,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "wall_clock_breakdown": _off_only("DeepSpeed's timers; logging.profiler traces the steps"),
    "zero_allow_untested_optimizer": lambda key, value, out, refused: out.append(Row(
        key, value, note="DeepSpeed's check of its own optimizers; FSDP2 takes any")),
}
