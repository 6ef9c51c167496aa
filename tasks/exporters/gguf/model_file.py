"""One GGUF file of a plain (merged) transformers model, in one of export.gguf's file types.

Every tensor is planned first (GGUF name, GGML type, byte size) and checked against its type's
block size, so a model a type cannot encode is refused before a byte is written. Then the header,
metadata and tensor table go out, and the tensors follow one at a time: converted to float32,
permuted for llama.cpp's rope, encoded, written, dropped. Only one tensor's copies are alive at
once, not a second model. The file is written under a temporary name beside `path` and renamed
at the end, so an interrupted export leaves no half-written file at `path`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

from finetune.errors import PipelineError
from tasks.exporters.gguf import quants
from tasks.exporters.gguf.families import Family, family_for
from tasks.exporters.gguf.vocab import write_vocab


@dataclass(frozen=True)
class _Planned:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


def write_model(model, tokenizer, path: Path, file_type: str, *, chat_template: str | None = None,
                generation_config=None, name: str | None = None) -> None:
    """`model` (a transformers causal LM, adapter already merged) and `tokenizer` as the GGUF
    file `path` of `file_type` (a key of quants.FILE_TYPES)."""
    if file_type not in quants.FILE_TYPES:
        raise PipelineError(f"export.gguf: unknown file type {file_type!r}; supported: "
                            f"{', '.join(quants.FILE_TYPES)}")
    config = model.config
    family = family_for(config)
    state = model.state_dict()
    plan = _plan(family, state, file_type, config.num_hidden_layers)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, family.arch)
    try:
        writer.add_name(name or Path(str(getattr(config, "_name_or_path", "") or "model")).name)
        writer.add_file_type(quants.FILE_TYPES[file_type][0])
        writer.add_quantization_version(GGML_QUANT_VERSION)
        family.write_hparams(writer, config)
        embed = next(p for p in plan if p.hf_name.startswith("model.embed_tokens."))
        write_vocab(writer, tokenizer, chat_template, n_vocab=embed.shape[0])
        _write_sampling(writer, generation_config)
        for p in plan:
            # the logical shape (a float dtype keeps it from being read as a byte shape)
            writer.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.float32), p.nbytes,
                                   raw_dtype=p.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plan:
            writer.write_tensor_data(_encoded(family, config, p, state[p.hf_name]))
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


def _plan(family: Family, state: dict, file_type: str, n_layers: int) -> list[_Planned]:
    """Each tensor's GGUF name and type, checked before anything is written. The output head is
    left out when it is the embedding (tied): llama.cpp then reuses token_embd."""
    return plan_tensors(family, {n: tuple(t.shape) for n, t in state.items()}, tied_head(state),
                        file_type, n_layers)


def tied_head(state: dict) -> bool:
    """The output head is the embedding: one tensor, or equal values (then no output.weight
    is written and llama.cpp reuses token_embd)."""
    embed = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight")
    return head is not None and embed is not None and (
        head.data_ptr() == embed.data_ptr() or torch.equal(head, embed))


def plan_tensors(family: Family, shapes: dict[str, tuple[int, ...]], tied: bool,
                 file_type: str, n_layers: int) -> list[_Planned]:
    """The plan from the tensors' shapes alone (the export stage's checks run it on a
    weightless model, before anything is written): one line for the first tensor with no
    GGUF name or whose rows are not whole blocks of the type `file_type` gives it."""
    plan = []
    for hf_name, shape in shapes.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        gguf_name = family.gguf_name(hf_name)
        if gguf_name is None:
            raise PipelineError(
                f"export.gguf: the model's tensor {hf_name} has no place in a {family.arch} "
                f"GGUF; only a plain (merged) model of a supported architecture can be written")
        qtype = quants.tensor_type(file_type, gguf_name, shape, n_layers,
                                   tied_embeddings=tied)
        quants.check_block(gguf_name, shape, qtype, file_type)
        plan.append(_Planned(gguf_name, hf_name, shape, qtype))
    return plan


def _encoded(family: Family, config, p: _Planned, tensor: torch.Tensor):
    rows = tensor.detach().to("cpu", torch.float32).numpy()
    if not np.isfinite(rows).all():  # a block scale of inf/NaN would poison the whole block
        raise PipelineError(f"export.gguf: {p.hf_name} holds NaN or inf values; the trained "
                            f"model is broken: look at the train stage's loss curve")
    return quants.encode(family.permute_rows(p.gguf_name, rows, config), p.qtype)


def _write_sampling(writer, generation_config) -> None:
    """The run's sampling defaults as `general.sampling.*`, which llama.cpp uses when the user
    gives none; a greedy generation config writes nothing (llama.cpp keeps its own defaults)."""
    if generation_config is None or not getattr(generation_config, "do_sample", False):
        return
    if (temp := getattr(generation_config, "temperature", None)) is not None:
        writer.add_sampling_temp(float(temp))
    if (top_p := getattr(generation_config, "top_p", None)) is not None:
        writer.add_sampling_top_p(float(top_p))
    if (top_k := getattr(generation_config, "top_k", None)) is not None:
        writer.add_sampling_top_k(int(top_k))
