"""Text -> token ids, the one way every data stage encodes (completion, chat, classification)."""

from __future__ import annotations


def token_ids(tok, texts: list[str]) -> list[list[int]]:
    """`tok(texts, add_special_tokens=False)["input_ids"]`, through the Rust backend's
    `encode_batch_fast` when the tokenizer is a fast one: same ids (it is the call transformers
    makes, minus character offsets we never use and the per-row BatchEncoding conversion),
    about 2x the throughput on Alpaca with the GPT-2 tokenizer. The backend is put in the state
    transformers' own call would put it in: no truncation, no padding, special-token splitting
    as the tokenizer says."""
    backend = getattr(tok, "_tokenizer", None)
    if not getattr(tok, "is_fast", False) or not hasattr(backend, "encode_batch_fast"):
        return tok(texts, add_special_tokens=False)["input_ids"]
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tok, "split_special_tokens", False))
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
