"""The PEFT adapter alone as a LoRA-GGUF, which llama.cpp applies to the base model's GGUF at
load time (`llama-cli -m base.gguf --lora adapter.gguf`).

llama.cpp's layout (src/llama-adapter.cpp): general.type `adapter`, adapter.type `lora`,
adapter.lora.alpha, and for each adapted weight `<its GGUF name>.lora_a` (rank x in, PEFT's
lora_A as it is) and `.lora_b` (out x rank, PEFT's lora_B; for attn_q/attn_k its rows in
llama.cpp's rotary order, as the base weight's are). It adds `scale * alpha / rank * B @ A x` to
each adapted matmul, rank read from lora_b: PEFT's alpha / r, one alpha for the whole file.

Refused, each in one line before anything is written, is what llama.cpp cannot apply that way:
DoRA (a magnitude vector), trained biases, modules trained in full (modules_to_save: an added
token's embeddings, a classifier head), adapters of the embeddings or output layer, and scalings
no single alpha expresses (per-module alpha_pattern; rsLoRA's alpha / sqrt(r) with ranks that
differ between modules, since llama.cpp divides by each module's rank).

The tensors are f16 (llama.cpp's converter's default: an adapter is small, and llama.cpp sums
its products in f32), or f32 when export.gguf lists f32: a run that asks for full precision
gets it for the adapter too.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.errors import PipelineError
from tasks.exporters.gguf.families import Family

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: a PEFT LoRA state-dict key: base_model.model.<module>.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")

#: modules whose GGUF tensors llama.cpp's LoRA loader treats apart (token_embd: A and B flipped)
#: or that a tied model does not have (output): not written
_NOT_ADAPTED = ("token_embd.weight", "output.weight")


def lora_type(gguf_types) -> str:
    """The LoRA-GGUF's tensor type for a run whose export.gguf lists `gguf_types`."""
    return "f32" if "f32" in gguf_types else "f16"


@dataclass(frozen=True)
class LoraTensor:
    """One adapted weight: its GGUF name and its PEFT keys."""

    gguf_name: str
    a_key: str
    b_key: str
    rank: int


@dataclass(frozen=True)
class LoraPlan:
    """What the LoRA-GGUF of an adapter folder holds, checked: written by `write_lora`."""

    folder: Path
    alpha: float
    tensors: tuple[LoraTensor, ...]


def plan(folder: Path, family: Family) -> LoraPlan:
    """The adapter in `folder` (PEFT's save_pretrained: adapter_config.json and
    adapter_model.safetensors) as llama.cpp would apply it; one line for anything it cannot."""
    from safetensors import safe_open

    where = f"the adapter in {folder}"
    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise PipelineError(f"export.gguf: {where} has no {ADAPTER_CONFIG} and "
                            f"{ADAPTER_WEIGHTS}; run the train stage again")
    cfg = json.loads(config_file.read_text())
    _refuse_config(cfg, where)
    pairs: dict[str, dict[str, str]] = {}
    with safe_open(weights, "pt") as f:
        keys = sorted(f.keys())
        ranks = {k: f.get_slice(k).get_shape() for k in keys}
    stray = []
    for key in keys:
        match = _KEY.match(key)
        if match is None:
            stray.append(key)
            continue
        module, side = match.groups()
        pairs.setdefault(module, {})[side] = key
    tensors = []
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise PipelineError(f"export.gguf: {where} has lora_{next(iter(sides))} of "
                                f"{module} without its pair")
        gguf_name = family.gguf_name(f"{module}.weight")
        if gguf_name is None or gguf_name in _NOT_ADAPTED:
            raise PipelineError(
                f"export.gguf: {where} adapts {module}, which a LoRA-GGUF of "
                f"{family.arch} cannot hold ({'its ' + gguf_name if gguf_name else 'no'} "
                "tensor); adapt attention and MLP layers, or set export.save_adapter false to "
                "write the merged GGUF alone")
        rank = ranks[sides["B"]][1]
        tensors.append(LoraTensor(gguf_name, sides["A"], sides["B"], rank))
    if stray:  # after the modules: an adapted lm_head also saves the layer it adapts
        raise PipelineError(
            f"export.gguf: {where} holds {stray[0]}, which is not a LoRA A/B matrix (a DoRA "
            "magnitude, a bias, a layer saved in full); llama.cpp applies only B @ A: set "
            "export.save_adapter false to write the merged GGUF alone")
    if not tensors:
        raise PipelineError(f"export.gguf: {where} holds no LoRA matrices")
    return LoraPlan(folder, _alpha(cfg, {t.rank for t in tensors}, where), tuple(tensors))


def _refuse_config(cfg: dict, where: str) -> None:
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise PipelineError(f"export.gguf: {where} is {kind}, not LoRA; a LoRA-GGUF holds "
                            "LoRA only")
    refusals = {
        "use_dora": "DoRA rescales each column by a magnitude vector llama.cpp does not apply",
        "modules_to_save": "modules trained in full ({value}) are not an adapter llama.cpp "
                           "applies",
        "alpha_pattern": "a per-module alpha ({value}); a LoRA-GGUF has one alpha",
        "trainable_token_indices": "token rows trained on their own ({value}) are not an "
                                   "adapter llama.cpp applies",
        "lora_bias": "a trained bias on lora_B, which llama.cpp does not add",
    }
    for key, why in refusals.items():
        value = cfg.get(key)
        if value:
            raise PipelineError(f"export.gguf: {where} has {key} {json.dumps(value)}: "
                                f"{why.format(value=value)}; set export.save_adapter false "
                                "to write the merged GGUF alone")


def _alpha(cfg: dict, ranks: set[int], where: str) -> float:
    """The alpha llama.cpp's alpha / rank turns into PEFT's scaling of every module: PEFT's
    lora_alpha; for rsLoRA (alpha / sqrt(r)) alpha * sqrt(r), which needs one rank."""
    alpha = float(cfg["lora_alpha"])
    if not cfg.get("use_rslora"):
        return alpha
    if len(ranks) > 1:
        raise PipelineError(
            f"export.gguf: {where} is rsLoRA with ranks {sorted(ranks)}: its alpha / sqrt(r) "
            "is no single alpha of llama.cpp's alpha / r; set export.save_adapter false to "
            "write the merged GGUF alone")
    return alpha * math.sqrt(next(iter(ranks)))


def write_lora(lora: LoraPlan, family: Family, hf_config, path: Path, tensor_type: str, *,
               name: str) -> None:
    """The LoRA-GGUF of `lora` at `path` (written beside it, then renamed into place)."""
    import gguf
    from safetensors import safe_open

    qtype = {"f16": gguf.GGMLQuantizationType.F16,
             "f32": gguf.GGMLQuantizationType.F32}[tensor_type]
    dtype = np.float16 if tensor_type == "f16" else np.float32
    # beside `path` (same filesystem: the rename is atomic), with the umask's permissions
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer = gguf.GGUFWriter(tmp, family.arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if tensor_type == "f16"
                             else gguf.LlamaFileType.ALL_F32)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
        with safe_open(lora.folder / ADAPTER_WEIGHTS, "pt") as f:  # "pt": bf16 too
            for t in lora.tensors:
                a = f.get_tensor(t.a_key).float().numpy()
                b = family.permute_rows(t.gguf_name, f.get_tensor(t.b_key).float().numpy(),
                                        hf_config)
                writer.add_tensor(f"{t.gguf_name}.lora_a", np.ascontiguousarray(a, dtype),
                                  raw_dtype=qtype)
                writer.add_tensor(f"{t.gguf_name}.lora_b", np.ascontiguousarray(b, dtype),
                                  raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
