"""torch.compile as the training section says: the whole model, or each decoder block in
place (torchtitan's regional compile), and what dynamo captured.
"""

from __future__ import annotations

import torch

from engine.modeling.model import base_model
from finetune.config.training import TrainingConfig
from finetune.errors import PipelineError


def maybe_compile(model, t: TrainingConfig):
    """The module the loop runs forward on; weights stay shared with the uncompiled one.

    `torch_compile_scope: blocks` (the default, torchtitan's regional compile) compiles each
    decoder block's forward in place: identical blocks share one compiled graph (compile time
    of one block, not of the model), the strategy's hooks (FSDP2's gathers, DDP) stay around
    them uncompiled, and parameter names do not change. `model` compiles the whole wrapped
    module (one graph per model, breaks at the chunked loss head)."""
    if not t.torch_compile:
        return model
    return compile_part(model, t, block_names(model))


def compile_part(module, t: TrainingConfig, blocks: set[str]):
    """`module` (a model, or a pipeline stage cut from one) compiled as the training section
    says: backend, mode, dynamic, fullgraph, and the scope (the whole module, or each of its
    decoder blocks, the classes named in `blocks`). The one place the engine calls
    torch.compile, so every strategy honours every compile option."""
    options = dict(backend=t.torch_compile_backend, mode=t.torch_compile_mode,
                   dynamic=t.torch_compile_dynamic, fullgraph=t.torch_compile_fullgraph)
    if t.torch_compile_scope == "model":
        return torch.compile(module, **options)
    found = [m for m in module.modules() if type(m).__name__ in blocks]
    if not found and not blocks:
        raise PipelineError(
            f"training.torch_compile_scope: blocks: {type(base_model(module)).__name__} names no "
            "decoder block class (_no_split_modules); set torch_compile_scope: model")
    for block in found:
        block.forward = torch.compile(block.forward, **options)
    return module


def block_names(model) -> set[str]:
    """The repeated blocks of a transformers model: the classes it names as never to be split
    across devices (`_no_split_modules`, what HF's device maps and FSDP wrapping use)."""
    return set(getattr(base_model(model), "_no_split_modules", None) or ())


def decoder_blocks(model) -> list[torch.nn.Module]:
    names = block_names(model)
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_stats() -> dict[str, int]:
    """How many graphs dynamo captured (0 when nothing was compiled)."""
    from torch._dynamo.utils import counters

    return {"torch_compile_graphs": int(counters["stats"]["unique_graphs"])}
