"""Low precision through torchao: FP8 training and quantisation-aware training (QAT).

- `training.fp8_recipe` converts the linear layers to Float8Linear (torchao.float8) for
  training: real fp8 matmuls, which need a CUDA GPU with compute capability >= 8.9 (H100, L4,
  RTX 40xx); layers whose dimensions are not multiples of `fp8_dim_alignment` stay in high
  precision and are listed. Anywhere else the run is refused with one line.
- `training.qat_recipe` fake-quantises the linear layers' weights (and activations, for
  int8-dynamic-act-int4-weight) during training (torchao's QATConfig "prepare" step), so the
  model learns weights that survive quantisation. LoRA keeps training its adapters in full
  precision around the fake-quantised frozen layers (torchtune's QAT + LoRA). The export
  stage merges the adapter and converts ("convert" step: the same quantiser applied to the
  merged weights) into the export's `quantized/` folder; the evaluate stage reports its loss.
  Layers whose input size is not a multiple of `qat_group_size` are left unquantised and
  listed (`quantization.json`). The output layer is never quantised. QAT has no hardware
  gate: the fake quantiser is plain torch and trains on CPU and GPU alike; only the
  conversion needs torchao's low-bit kernels (here: int8-dynamic-act-int4-weight on CPU,
  int4-weight-only needs mslk's CUDA kernels, float8 a GPU of SM >= 8.9), which
  `conversion_blocker` finds out by converting one layer.

torchao is imported only when a recipe is set (`pip install 'finetune-pipeline[torchao]'`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from finetune.errors import PipelineError

INFO = "quantization.json"
WEIGHTS = "quantized_state_dict.pt"


def torchao_module(key: str):
    try:
        import torchao
    except ImportError as exc:
        raise PipelineError(f"{key} needs torchao, which is not installed: "
                            "pip install 'finetune-pipeline[torchao]'") from exc
    return torchao


def base_config(recipe: str, group_size: int):
    """torchao's post-training config that QAT simulates and the export applies."""
    torchao_module("training.qat_recipe")
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationIntxWeightConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if recipe == "int8-dynamic-act-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                     weight_granularity=PerGroup(group_size))
    if recipe == "int4-weight-only":
        return Int4WeightOnlyConfig(group_size=group_size)
    return Float8DynamicActivationFloat8WeightConfig()


#: PEFT's own modules (adapters, trained copies) stay in full precision
ADAPTER_PARTS = ("lora_", "modules_to_save", "original_module", "token_adapter")


def _candidate(module: nn.Module, fqn: str) -> bool:
    """A model linear layer low precision applies to: not the output layer, not an adapter."""
    return (isinstance(module, nn.Linear) and not fqn.endswith("lm_head")
            and not any(part in fqn for part in ADAPTER_PARTS))


def quantizable(group_size: int):
    """filter_fn: candidate layers whose input size the group divides."""
    def keep(module: nn.Module, fqn: str) -> bool:
        return _candidate(module, fqn) and module.in_features % group_size == 0
    return keep


def skipped_layers(model: nn.Module, group_size: int) -> list[str]:
    return [fqn for fqn, m in model.named_modules()
            if _candidate(m, fqn) and m.in_features % group_size]


def conversion_blocker(recipe: str, group_size: int, device: torch.device) -> str | None:
    """Why torchao cannot convert `recipe` on `device` (None: it can), found by converting one
    small layer and running it: which low-bit kernels exist depends on the device and on the
    installed packages (int4-weight-only needs mslk's kernels, float8 a GPU of SM >= 8.9), so
    the probe is the truth. QAT's training itself (the fake quantiser: plain torch ops) runs
    on every device; only this conversion, done by the evaluate and export stages, needs them."""
    from torchao.quantization import quantize_

    probe = nn.Sequential(nn.Linear(group_size, 16, dtype=torch.bfloat16, device=device))
    try:
        quantize_(probe, base_config(recipe, group_size))
        probe(torch.zeros(1, group_size, dtype=torch.bfloat16, device=device))
    except (ImportError, AssertionError, NotImplementedError, RuntimeError) as exc:
        return str(exc).strip().splitlines()[0] or type(exc).__name__
    return None


def check_convertible(recipe: str, group_size: int, device: torch.device) -> None:
    """The export's `quantized` format converts to real low-bit kernels: one line where it
    cannot on this device (the export writes nothing; earlier outputs stay)."""
    reason = conversion_blocker(recipe, group_size, device)
    if reason:
        raise PipelineError(
            f"export.formats quantized: training.qat_recipe {recipe} cannot be converted on "
            f"{device.type} here (torchao: {reason}); export on a machine that can, or drop "
            "quantized from export.formats")


def check_low_precision(cfg, device: torch.device) -> None:
    """Before launch: what the fp8/QAT recipe needs, as one line. QAT trains on any device;
    refused here only when export.formats asks for the converted model and this machine
    cannot convert that recipe (found out now, not after training)."""
    t = cfg.training
    if t.fp8_recipe:  # its GPU: a machine row of finetune/config/compat.py
        torchao_module("training.fp8_recipe")
    if t.qat_recipe:
        torchao_module("training.qat_recipe")
        reason = (conversion_blocker(t.qat_recipe, t.qat_group_size, device)
                  if "quantized" in cfg.export.formats else None)
        if reason:
            raise PipelineError(
                f"training.qat_recipe {t.qat_recipe}: QAT trains on {device.type}, but "
                f"export.formats quantized cannot convert it here (torchao: {reason}); drop "
                "quantized from export.formats (the export then ships the QAT-trained weights "
                "unconverted) or use int8-dynamic-act-int4-weight, which converts on CPU")


def prepare_qat(model: nn.Module, recipe: str, group_size: int, log) -> None:
    """Fake-quantise the model's linear layers in place for training."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    skipped = skipped_layers(model, group_size)
    quantize_(model, QATConfig(base_config(recipe, group_size), step="prepare"),
              filter_fn=quantizable(group_size))
    log(f"[train] QAT {recipe} (group size {group_size}): linear layers fake-quantised"
        + (f"; left in full precision (input size not a multiple of {group_size}): "
           f"{', '.join(skipped)}" if skipped else ""))


def convert(model: nn.Module, recipe: str, group_size: int) -> list[str]:
    """Quantise a merged model in place (QAT's convert: the simulated quantiser, for real);
    returns the layers left in full precision."""
    from torchao.quantization import quantize_

    skipped = skipped_layers(model, group_size)
    quantize_(model, base_config(recipe, group_size), filter_fn=quantizable(group_size))
    return skipped


def quantized_copy(model: nn.Module, recipe: str, group_size: int) -> tuple[nn.Module, list]:
    """The fine-tuned model as the export ships it quantised: a copy, its adapter merged,
    converted. The evaluate and export stages both call this, so the loss reported is the
    artifact's."""
    import copy

    merged = copy.deepcopy(model)
    if hasattr(merged, "merge_and_unload"):
        merged = merged.merge_and_unload()
    return merged, convert(merged, recipe, group_size)


def save_quantized(model: nn.Module, folder: Path, recipe: str, group_size: int,
                   skipped: list[str]) -> None:
    """config.json + the quantised state dict (torchao tensors, torch.save) + what was done;
    `load_quantized` rebuilds it."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / WEIGHTS)
    (folder / INFO).write_text(json.dumps(
        {"recipe": recipe, "group_size": group_size, "skipped_layers": skipped,
         "load": "engine.modeling.quantization.load_quantized(folder)"}, indent=2) + "\n")


def load_quantized(folder: Path) -> nn.Module:
    """The model `save_quantized` wrote: built from its config, quantised the same way, then
    given the saved low-bit weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    info: dict[str, Any] = json.loads((folder / INFO).read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    convert(model, info["recipe"], info["group_size"])
    state = torch.load(folder / WEIGHTS, weights_only=False)
    model.load_state_dict(state, assign=True)
    return model.eval()


def convert_to_fp8(model: nn.Module, recipe: str, alignment: int, device: torch.device,
                   log) -> None:
    """Float8Linear training (torchao.float8) on a CUDA GPU with SM >= 8.9 (the machine rows
    of finetune/config/compat.py refuse it elsewhere, before this runs)."""
    torchao_module("training.fp8_recipe")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    skipped: list[str] = []

    def aligned(module: nn.Module, fqn: str) -> bool:
        if not _candidate(module, fqn):
            return False
        ok = module.in_features % alignment == 0 and module.out_features % alignment == 0
        if not ok:
            skipped.append(fqn)
        return ok

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=aligned)
    log(f"[train] fp8 {recipe}: linear layers are Float8Linear"
        + (f"; kept in high precision: {', '.join(skipped)}" if skipped else ""))
