"""Batched greedy generation for the evaluate stage: left-padded batches, stop at EOS.

Prompts are encoded exactly as the tokenize stage encodes them for training (BOS only if the
tokenizer adds one, no other special tokens), so the model sees at evaluation the prefix it
was trained to continue. The texts are Hugging Face `generate`'s greedy ones. Where a model's
one-token forward is the one engine.rollout.lean_decode reproduces (a Llama, Mistral or Qwen2
causal LM with SDPA) and its generation config adds no logits processor, the rollout room's
`LocalGenerator` produces them instead, at temperature 0 with the adapters left unfolded:
the same logits bitwise (the lean decode step, a cache written in place), so the same argmax
tokens, with 1.26-1.46x less CPU than generate on stories260K (LoRA unfolded / none;
tests/test_grpo_generation.py checks the texts against `generate`'s). Any other model (an
encoder-decoder, a vision-language model with its image inputs, another architecture) runs
`generate`.
"""

from __future__ import annotations

from typing import Callable

import torch

from finetune.datatypes.encoding import bos_prefix_id

#: generation-config keys that change no greedy token: a model whose own generation config
#: sets any other (a repetition penalty, suppressed or forced tokens, a minimum length, ...)
#: keeps `generate`, which applies it
NEUTRAL_GENERATION_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                           "transformers_version", "_from_model_config", "use_cache",
                           "max_length", "max_new_tokens", "do_sample", "temperature", "top_p",
                           "top_k", "num_beams", "num_return_sequences", "output_attentions",
                           "output_hidden_states", "output_scores", "output_logits",
                           "return_dict_in_generate"}


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
    local = _local_generator(model, max_new_tokens, eos, pad) if extras is None else None
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
        cut = generated_from(width) if generated_from else width
        if local is not None and cut == width:  # a decoder-only model's answer follows its prompt
            # right-padded with pad after each row's EOS, as generate pads finished rows
            new = local.generate(ids.to(device), mask.to(device), num_generations=1, seed=0).ids
        else:
            more = extras(range(start, start + len(chunk)), width) if extras else {}
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=config,
                                 **{k: v.to(device) for k, v in more.items()})
            new = out[:, cut:]
        for row in new.tolist():
            if eos in row:
                row = row[: row.index(eos)]
            texts.append(tok.decode(row, skip_special_tokens=True))
        if on_batch is not None:
            on_batch()
    model.train(was_training)
    return texts


def _local_generator(model, max_new_tokens: int, eos: int, pad: int):
    """The rollout room's generator at temperature 0 where its tokens are `generate`'s greedy
    ones (see the module docstring); None where `generate` must run."""
    from engine.rollout.lean_decode import lean_layout
    from engine.rollout.local import LocalGenerator
    from engine.rollout.sampling import SamplingParams

    if not isinstance(model, torch.nn.Module):  # a wrapper with its own generate (ranks kept
        return None                             # in step: engine.recipe.sft.in_training)
    if eos is None or pad is None or not lean_layout(model):
        return None
    own = getattr(model, "generation_config", None)
    if own is not None and set(own.to_diff_dict()) - NEUTRAL_GENERATION_KEYS:
        return None
    # adapters unfolded (merge_adapters=False): the forward's arithmetic, as generate runs it
    return LocalGenerator(model, SamplingParams(max_completion_length=max_new_tokens,
                                                temperature=0.0),
                          eos_token_ids=[eos], pad_token_id=pad, merge_adapters=False)
