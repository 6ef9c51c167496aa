"""The tokenizer as llama.cpp reads it: `tokenizer.ggml.*` metadata instead of tokenizer.json.

Read from the `tokenizers` JSON every fast tokenizer carries, so no `sentencepiece` is needed.
Two kinds are written:

- `llama`: SentencePiece-style BPE with byte fallback (Llama 1/2, TinyLlama, stories260K). llama.cpp
  merges the adjacent pair whose merged piece has the highest score, so each piece's score is
  minus the rank of the first merge that makes it: the same order transformers' merge ranks give.
- `gpt2`: byte-level BPE (GPT-2, SmolLM, Llama 3): tokens in the byte alphabet, the merges, and
  `tokenizer.ggml.pre`, the name llama.cpp knows the pre-tokenizer's split rule by.

Anything else is refused in one line rather than written as a vocabulary llama.cpp would
tokenize differently.
"""

from __future__ import annotations

import json
import re

from gguf import TokenType

from finetune.errors import PipelineError

_BYTE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

#: Llama 3's split rule (its tokenizer.json's Split regex), llama.cpp's `llama-bpe`
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SUPPORTED = ("SentencePiece-style BPE with byte fallback (llama)",
             "byte-level BPE with GPT-2's, SmolLM's or Llama 3's pre-tokenizer (gpt2)")


def write_vocab(writer, tokenizer, chat_template: str | None = None, *,
                n_vocab: int | None = None) -> None:
    """`tokenizer`'s vocabulary, special ids and chat template into `writer`. `n_vocab` (the
    embedding's rows) pads the token list with unused `[PAD<i>]` tokens, as llama.cpp needs one
    token per embedding row."""
    spec = _spec(tokenizer)
    kind = _kind(spec)
    tokens, types = _tokens(spec, tokenizer, kind)
    if n_vocab is not None:
        if len(tokens) > n_vocab:
            raise PipelineError(
                f"export.gguf: the tokenizer has {len(tokens)} tokens but the model's embedding "
                f"only {n_vocab} rows; resize the embedding to the tokenizer before exporting")
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
    writer.add_tokenizer_model(kind)
    if kind == "llama":
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(_scores(spec, tokens, types))
        writer.add_token_types(types)
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    else:
        writer.add_tokenizer_pre(_pre(spec))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                                 for m in spec["model"]["merges"]])
    _write_specials(writer, tokenizer)
    if chat_template:
        writer.add_chat_template(chat_template)


def _spec(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise PipelineError(
            f"export.gguf: the tokenizer ({type(tokenizer).__name__}) has no tokenizers-library "
            f"form to write as GGUF; supported: {'; '.join(SUPPORTED)}")
    return json.loads(backend.to_str())


def _kind(spec: dict) -> str:
    model = spec["model"]
    if model.get("type") == "BPE" and model.get("byte_fallback") and _uses_metaspace(spec):
        return "llama"
    pre_steps = _steps(spec.get("pre_tokenizer"))
    if (model.get("type") == "BPE" and not model.get("byte_fallback") and pre_steps
            and pre_steps[-1]["type"] == "ByteLevel"):
        _pre(spec)  # refuse an unknown split rule now
        return "gpt2"
    pre = (spec.get("pre_tokenizer") or {}).get("type")
    raise PipelineError(
        f"export.gguf: the tokenizer ({model.get('type')} model, pre-tokenizer {pre}) cannot be "
        f"written as GGUF; supported: {'; '.join(SUPPORTED)}")


def _steps(part: dict | None) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps, a Sequence flattened."""
    if not part:
        return []
    if part["type"] == "Sequence":
        return [s for p in part.get("pretokenizers") or part.get("normalizers") or []
                for s in _steps(p)]
    return [part]


def _uses_metaspace(spec: dict) -> bool:
    """Spaces become `▁`: by a Metaspace pre-tokenizer, or by the older normalizer that
    prepends and replaces."""
    if any(s["type"] == "Metaspace" for s in _steps(spec.get("pre_tokenizer"))):
        return True
    return any(s["type"] == "Replace" and s.get("content") == "\u2581"
               for s in _steps(spec.get("normalizer")))


def _adds_space_prefix(spec: dict) -> bool:
    for s in _steps(spec.get("pre_tokenizer")):
        if s["type"] == "Metaspace":
            return s.get("prepend_scheme", "always") != "never" and s.get("add_prefix_space", True)
    return any(s["type"] == "Prepend" for s in _steps(spec.get("normalizer")))


def _pre(spec: dict) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer's split rule."""
    steps = _steps(spec.get("pre_tokenizer"))
    shape = []
    for s in steps:
        if s["type"] == "ByteLevel":
            shape.append(("ByteLevel", s.get("use_regex", True), s.get("add_prefix_space", False)))
        elif s["type"] == "Digits":
            shape.append(("Digits", s.get("individual_digits", False)))
        elif s["type"] == "Split":
            shape.append(("Split", s["pattern"].get("Regex"), s.get("behavior")))
        else:
            shape.append((s["type"],))
    known = {
        (("ByteLevel", True, False),): "gpt-2",
        (("Digits", True), ("ByteLevel", True, False)): "smollm",
        (("Split", _LLAMA3_SPLIT, "Isolated"), ("ByteLevel", False, False)): "llama-bpe",
    }
    if tuple(shape) not in known:
        raise PipelineError(
            f"export.gguf: the tokenizer's pre-tokenizer ({', '.join(s[0] for s in shape)}) is "
            f"not one llama.cpp knows by name; supported: {'; '.join(SUPPORTED)}")
    return known[tuple(shape)]


def _tokens(spec: dict, tokenizer, kind: str) -> tuple[list[str], list[TokenType]]:
    """Tokens by id and their llama.cpp types: the unknown piece unknown (llama kind), added
    special tokens control, other added tokens user-defined, `<0xNN>` pieces bytes (llama
    kind), the rest normal."""
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    missing = sorted(set(range(len(by_id))) - set(by_id))
    if missing:
        raise PipelineError(
            f"export.gguf: the tokenizer has no token with id {missing[0]}; GGUF needs ids "
            f"0..{len(by_id) - 1} without gaps")
    tokens = [by_id[i] for i in range(len(by_id))]
    # SentencePiece has an unknown piece; in byte-level BPE every byte is a token, and an
    # `unk_token` there (GPT-2's is <|endoftext|>) is a control token to llama.cpp
    unk = getattr(tokenizer, "unk_token_id", None) if kind == "llama" else None
    types = []
    for i, token in enumerate(tokens):
        if i == unk:
            types.append(TokenType.UNKNOWN)
        elif i in added:
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        elif kind == "llama" and _BYTE.match(token):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return tokens, types


def _scores(spec: dict, tokens: list[str], types: list[TokenType]) -> list[float]:
    """Minus the rank of the first merge that makes each piece; pieces no merge makes (single
    characters, bytes, specials) rank after every merge, in id order."""
    rank = {}
    merges = spec["model"]["merges"]
    for r, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        rank.setdefault(left + right, r)
    scores = []
    for i, token in enumerate(tokens):
        if types[i] != TokenType.NORMAL:
            scores.append(0.0)
        elif token in rank:
            scores.append(-float(rank[token]))
        else:
            scores.append(-float(len(merges) + i))
    return scores


def _write_specials(writer, tokenizer) -> None:
    """bos/eos/unk/pad ids, and whether encoding adds bos/eos (found by encoding, so it holds
    whatever the tokenizer's post-processor does)."""
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")}
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if isinstance(ids[name], int):
            add(ids[name])
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    extra = len(full) - len(plain)
    add_bos = extra > 0 and ids["bos"] is not None and full[0] == ids["bos"] != plain[0]
    add_eos = extra > 0 and ids["eos"] is not None and full[-1] == ids["eos"] != plain[-1]
    writer.add_add_bos_token(bool(add_bos))
    writer.add_add_eos_token(bool(add_eos))
