"""Batched greedy generation for the evaluate stage: left-padded batches, stop at EOS.

Prompts are encoded exactly as the tokenize stage encodes them for training (BOS only if the
tokenizer adds one, no other special tokens), so the model sees at evaluation the prefix it
was trained to continue. It runs Hugging Face `generate` (not `LocalGenerator`): its texts are
what the evaluate stage has always scored, and any model `generate` serves (an
encoder-decoder too) generates here.
"""

from __future__ import annotations

from typing import Callable

import torch

from finetune.datatypes.encoding import bos_prefix_id


def encode_prompts(tok, prompts: list[str], max_prompt_tokens: int | None) -> list[list[int]]:
    """Token ids per prompt; too-long prompts keep their last `max_prompt_tokens` tokens (the
    end of a prompt, next to where the answer starts, matters most)."""
    bos = bos_prefix_id(tok)
    encoded = tok(prompts, add_special_tokens=False)["input_ids"]
    out = []
    for ids in encoded:
        ids = ([bos] if bos is not None else []) + ids
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        out.append(ids)
    return out


@torch.no_grad()
def greedy_generate(model, tok, prompts: list[list[int]], batch_size: int,
                    max_new_tokens: int, device: torch.device | None = None,
                    on_batch: Callable[[], None] | None = None,
                    generated_from: Callable[[int], int] | None = None,
                    extras: Callable[[range, int], dict] | None = None) -> list[str]:
    """Greedy continuations (decoded, special tokens dropped), one per prompt, in order.
    `on_batch()`: called after each batch (a progress bar). `generated_from(prompt width)`:
    where the new tokens start in `generate`'s output, the model kind's answer
    (engine.kinds: ModelKind.generated_from); None: after the prompt (a decoder-only model).
    `extras(prompt indices, width)`: the batch's further model inputs (a vision-language
    model's images), laid out for its left-padded width."""
    from transformers import GenerationConfig

    device = device or next(model.parameters()).device
    pad, eos = tok.pad_token_id, tok.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos, pad_token_id=pad, use_cache=True)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):  # left padding: every prompt ends at the same column
            ids[row, width - len(p):] = torch.as_tensor(p)
            mask[row, width - len(p):] = 1
        more = extras(range(start, start + len(chunk)), width) if extras else {}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=config,
                             **{k: v.to(device) for k, v in more.items()})
        cut = generated_from(width) if generated_from else width
        for row in out[:, cut:].tolist():
            if eos in row:
                row = row[: row.index(eos)]
            texts.append(tok.decode(row, skip_special_tokens=True))
        if on_batch is not None:
            on_batch()
    model.train(was_training)
    return texts
