"""A GGUF file as the base model (model.gguf_file): which file, what its tensors hold, and the
dense model transformers hands back. engine/modeling/model.py makes the `from_pretrained`
calls; this module gives them their arguments and cleans up after them.

transformers reads a GGUF checkpoint through its GGUF quantizer. Without our say it may keep
the weights packed in GGUF blocks (`GgufLinear`, where a matmul kernel is published for the
device) and it marks the loaded model as quantized either way, which makes it untrainable by
its own rules and unsavable (`save_pretrained` refuses a GGUF-quantized model). Training needs
a dense model, so the load asks for every weight dequantized (`GgufConfig(dequantize=True)`)
and the quantizer is taken off the model afterwards: what remains is a plain transformers
model in model.dtype, saved and merged as one loaded from safetensors is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from finetune.config.model import ModelConfig
from finetune.errors import PipelineError

#: GGUF tensor types that are plain floats: loading them is a cast, not a dequantization
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_argument(cfg: ModelConfig, ref: str) -> str | None:
    """`gguf_file` for from_pretrained on `ref` (model.name_or_path resolved): the file's
    absolute path in a local folder (transformers would first look for a bare name in the
    working directory), the name as given in a hub repo; None without model.gguf_file.
    A local file that is not there is one line naming the key and the path."""
    if not cfg.gguf_file:
        return None
    folder = Path(ref)
    if not folder.exists():  # a hub repo: the file is fetched (or found in the cache) by name
        return cfg.gguf_file
    path = folder / cfg.gguf_file
    if not path.is_file():
        raise PipelineError(f"model.gguf_file: {path} not found (a GGUF file in "
                            f"model.name_or_path {cfg.name_or_path})")
    return str(path)


def dense_load_kwargs() -> dict[str, Any]:
    """from_pretrained arguments that load a GGUF file as a dense model (every weight
    dequantized, none kept in packed blocks)."""
    from transformers import GgufConfig

    return {"quantization_config": GgufConfig(dequantize=True)}


def quantized_types(path: str) -> list[str]:
    """The file's quantized tensor types (Q8_0, Q4_K, ...), in file order, each once; [] for
    a file of plain floats. Reads the header only (gguf.GGUFReader maps the file)."""
    from gguf import GGUFReader

    names = (t.tensor_type.name for t in GGUFReader(path, "r").tensors)
    return list(dict.fromkeys(n for n in names if n not in FLOAT_TYPES))


def local_file(cfg: ModelConfig, ref: str, argument: str) -> str:
    """The GGUF file on this disk: the local path, or the hub cache's copy (which
    from_pretrained has just downloaded)."""
    if Path(argument).is_file():
        return argument
    from huggingface_hub import hf_hub_download

    return hf_hub_download(ref, argument, revision=cfg.revision)


def as_dense_model(model, cfg: ModelConfig, ref: str, argument: str,
                   log: Callable[[str], None]):
    """The model from_pretrained loaded from the GGUF file, its quantizer removed (it was
    dequantized on load: nothing is packed). Logs one line when the file held quantized
    types, which were dequantized."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    types = quantized_types(local_file(cfg, ref, argument))
    if types:
        dtype = str(model.dtype).removeprefix("torch.")
        log(f"[model] {Path(argument).name} holds {', '.join(types)} tensors: dequantized to "
            f"{dtype} on load (transformers' GGUF loader)")
    return model
