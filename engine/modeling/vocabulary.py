"""A vocabulary that grows (model.added_tokens, model.special_tokens): new embedding and output
rows, initialised the same way on every load, and the layers that must then train in full."""

from __future__ import annotations

import torch

#: set on a model whose vocabulary grew: its embedding and output layers must train; the value
#: is the first new row (the rows from it on are the added tokens')
GREW = "_finetune_grew_vocabulary"


def grow_vocabulary(model, size: int) -> int:
    """Embedding (and output) rows up to `size` tokens; the new rows are the mean of the old
    ones, so every load of the same base model gives the same weights (transformers' own
    initialisation draws random rows) and a new token starts as an average token. Returns the
    rows added."""
    old = model.get_input_embeddings().weight.shape[0]
    if size <= old:
        return 0
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        layers = [model.get_input_embeddings(), model.get_output_embeddings()]
        for layer in {id(m): m for m in layers if m is not None}.values():
            layer.weight[old:] = layer.weight[:old].mean(dim=0)
            if getattr(layer, "bias", None) is not None:
                layer.bias[old:] = layer.bias[:old].mean()
    setattr(model, GREW, old)
    return size - old


def embedding_module_names(model) -> list[str]:
    """The names of the input embedding and output layers (modules_to_save)."""
    wanted = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if id(m) in wanted})


def added_rows(model) -> list[int]:
    """The token ids the vocabulary grew by (peft.trainable_token_indices: added); none when
    it did not grow."""
    first = getattr(model, GREW, None)
    if first is None:
        return []
    return list(range(first, model.get_input_embeddings().weight.shape[0]))
