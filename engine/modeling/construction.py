"""`training.construct_model_on: meta`: the base model built without its weights, then only
this rank's part read from the checkpoint.

The skeleton comes from the model config on the meta device (no memory, no random init). Each
base parameter is then a zero-storage placeholder: a stride-0 view of one CPU element with the
parameter's shape and dtype. Placeholders, not meta tensors, because the adapter is attached
before the strategy cuts the model: PEFT creates its weights on the base layer's device and
would put them on meta (losing their values); on a placeholder's CPU it initialises them
exactly as on the default path, from the same random draws, so every construction gives the
same adapter. The strategy then drops what this rank does not run (pipeline: other stages) and
`materialise` reads the remaining placeholders' tensors from the safetensors files straight
onto the training device: a rank never holds the weights of a stage it does not run. Each
placeholder remembers the checkpoint names it may be stored under (tied weights: either).
Non-persistent buffers (rotary tables) are computed by transformers' own initialiser.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from finetune.errors import PipelineError

#: attribute on a placeholder parameter or buffer: the checkpoint names it may be stored under
SOURCE = "_finetune_checkpoint_names"
KEY = "training.construct_model_on meta"


def _placeholder(t: torch.Tensor, names: list[str], parameter: bool) -> torch.Tensor:
    data = torch.empty((), dtype=t.dtype).expand(t.shape)
    out = nn.Parameter(data, requires_grad=t.requires_grad) if parameter else data
    setattr(out, SOURCE, names)
    return out


def skeleton(factory, config, **kwargs):
    """The model of `config` with placeholders for its stored tensors (no weight memory).
    `factory`: the class to build (its from_config, an Auto class's, or _from_config)."""
    build = getattr(factory, "from_config", None) or getattr(factory, "_from_config", None)
    if build is None:
        raise PipelineError(f"{KEY}: {factory.__name__} cannot be built from a config; use "
                            "construct_model_on: default")
    with torch.device("meta"):
        model = build(config, **kwargs)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    stored = set(model.state_dict())  # persistent buffers included
    made: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = _placeholder(p, aliases[id(p)], parameter=True)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and f"{dot}{name}" in stored:
                module._buffers[name] = _placeholder(b, [f"{dot}{name}"], parameter=False)
    return model


def checkpoint_files(ref: str, revision: str | None) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it, for a local folder or a hub id (the
    files come from the hub cache, downloaded once)."""
    folder = Path(ref)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(ref, revision=revision, allow_patterns=[
                "*.safetensors", "*.safetensors.index.json"]))
        except Exception as exc:  # the hub's errors are many; the message names the cause
            raise PipelineError(f"{KEY}: model {ref}: cannot fetch its safetensors files "
                                f"({type(exc).__name__}); use construct_model_on: default "
                                "or a local folder") from None
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise PipelineError(f"{KEY}: {folder} has no model.safetensors (or its index): the "
                            "meta construction reads safetensors only; use construct_model_on: "
                            "default")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class _StoredTensors:
    """The checkpoint's tensors by name, each safetensors file opened once."""

    def __init__(self, ref: str, revision: str | None):
        self.files = checkpoint_files(ref, revision)
        self._handles: dict[Path, object] = {}

    def open(self, names: list[str]):
        """(the open file, the name) of the first of `names` the checkpoint has."""
        from safetensors import safe_open

        found = next((n for n in names if n in self.files), None)
        if found is None:
            raise PipelineError(f"{KEY}: the checkpoint has no tensor {names[0]}; use "
                                "construct_model_on: default")
        path = self.files[found]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path], found


def _swap_placeholders(model, make) -> int:
    """Every placeholder in `model` replaced by `make(placeholder)`, called once per tensor
    (a tied weight stays one tensor). Returns how many were made."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slot in (module._parameters, module._buffers):
            for name, t in list(slot.items()):
                if t is None or not hasattr(t, SOURCE):
                    continue
                if id(t) not in made:
                    value = make(t)
                    made[id(t)] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else value)
                slot[name] = made[id(t)]
    return len(made)


def _load(model, stored: _StoredTensors, device: torch.device) -> tuple[int, int]:
    """Every placeholder of `model`, read from its file onto `device`. Returns (tensors,
    bytes) read."""
    read_bytes = 0

    def read(t: torch.Tensor) -> torch.Tensor:
        nonlocal read_bytes
        handle, found = stored.open(getattr(t, SOURCE))
        value = handle.get_tensor(found).to(device=device, dtype=t.dtype)
        if value.shape != t.shape:
            raise PipelineError(f"{KEY}: {found} is {tuple(value.shape)} in the checkpoint, "
                                f"the model wants {tuple(t.shape)}")
        read_bytes += value.numel() * value.element_size()
        return value

    return _swap_placeholders(model, read), read_bytes


def _compute_buffers(model, device: torch.device) -> None:
    """Non-persistent buffers (still on meta) through transformers' initialiser, which
    computes them (rotary inverse frequencies) as from_pretrained does."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's
    for prefix, module in model.named_modules():
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        if any(p is not None for p in module._parameters.values()):  # the init would reset them
            raise PipelineError(f"{KEY}: module {prefix} has computed buffers next to its "
                                "weights; use construct_model_on: default")
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
        lm._init_weights(module)
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            raise PipelineError(f"{KEY}: buffer {prefix} has no stored or computed value; use "
                                "construct_model_on: default")


def materialise(model, ref: str, revision: str | None, device: torch.device) -> dict:
    """Read every placeholder left in `model` (this rank's part) onto `device`, compute the
    non-persistent buffers, move the rest (adapters) there. Returns what was read."""
    tensors, read = _load(model, _StoredTensors(ref, revision), device)
    _compute_buffers(model, device)
    model.to(device)
    return {"construct_tensors_read": tensors, "construct_bytes_read": read}


# -- sharded strategies (FSDP2): each rank reads only its shard of every tensor ------------
# The placeholders become meta tensors before fully_shard (FSDP2 shards meta parameters without
# allocating and leaves them where they are), `to_empty` then gives each rank its local shards,
# and each shard is read as a slice of the stored tensor (safetensors reads slices without
# loading the rest). What is real before the wrap (adapter weights, computed buffers) is kept
# across to_empty, which reallocates every tensor.


def defer_to_meta(model, device: torch.device) -> dict[str, list[str]]:
    """Placeholders -> meta tensors, computed buffers made on `device`; returns each stored
    tensor's qualified name -> the checkpoint names it may be stored under."""
    _compute_buffers(model, device)
    every = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    sources = {name: getattr(t, SOURCE) for name, t in every if hasattr(t, SOURCE)}
    _swap_placeholders(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return sources


def _local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """A (possibly distributed) tensor's local tensor and where it sits in the whole one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def read_shards(model, sources: dict[str, list[str]], ref: str, revision: str | None,
                device: torch.device) -> dict:
    """After the strategy sharded the meta model: allocate this rank's shards on `device`
    and fill them (stored tensors as slices of the checkpoint, the rest as they were)."""
    stored = _StoredTensors(ref, revision)
    named = lambda: [*model.named_parameters(), *model.named_buffers()]  # noqa: E731
    kept = {name: local.detach().clone() for name, t in named()
            if not (local := _local_part(t)[0]).is_meta}
    model.to_empty(device=device)
    tensors = read_bytes = 0
    with torch.no_grad():
        for name, t in named():
            local, where = _local_part(t)
            if name in kept:
                local.copy_(kept[name])
                continue
            handle, found = stored.open(sources.get(name, [name]))
            part = handle.get_slice(found)[where] if local.numel() else None
            if part is not None:
                local.copy_(part.to(dtype=local.dtype))
                read_bytes += part.numel() * part.element_size()
            tensors += 1
    return {"construct_tensors_read": tensors, "construct_bytes_read": read_bytes}


def has_placeholders(model) -> bool:
    return any(hasattr(t, SOURCE) for t in [*model.parameters(), *model.buffers()])
