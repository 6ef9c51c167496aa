"""The merged-model GGUF writer (tasks/exporters/gguf/model_file.py, families.py, vocab.py).

The independent reader is transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`): it
undoes llama.cpp's names and q/k row order and rebuilds the tokenizer from `tokenizer.ggml.*`,
so a file it reads back into the same logits and ids has llama.cpp's layout. `gguf.GGUFReader`
checks the metadata and tensor table as llama.cpp sees them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf import quants as gguf_quants
from helpers import ROOT
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from finetune.errors import PipelineError
from tasks.exporters.gguf import model_file, quants
from tasks.exporters.gguf.families import family_for
from tasks.exporters.gguf.model_file import write_model

STORIES = ROOT / "data/models/stories260K"
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def stories():
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 512, (3, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def written(stories, tmp_path_factory):
    """stories260K as f32, f16 and bf16 GGUF files, written once."""
    folder = tmp_path_factory.mktemp("gguf")
    model, tokenizer = stories
    for file_type in ("f32", "f16", "bf16"):
        write_model(model, tokenizer, folder / f"stories-{file_type}.gguf", file_type,
                    chat_template=TEMPLATE)
    return folder


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch).logits


def read_back(folder, name):
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def rounded(model, to_file):
    """A copy of `model` whose 2-D weights went through `to_file` and back, as a GGUF file of
    that type stores them (norms stay float32)."""
    copy = type(model)(model.config).eval()
    state = {name: (torch.from_numpy(to_file(t.numpy())) if t.dim() == 2 else t)
             for name, t in model.state_dict().items()}
    copy.load_state_dict(state)
    return copy


def f16(w):
    return w.astype(np.float16).astype(np.float32)


def bf16(w):
    return torch.from_numpy(w).to(torch.bfloat16).float().numpy()


def q8_0(w):
    return gguf_quants.dequantize(quants.encode(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)


def test_f32_gguf_gives_the_same_logits_exactly(stories, written, batch):
    model, _ = stories
    back = read_back(written, "stories-f32.gguf")
    assert back.config.tie_word_embeddings  # no output.weight: llama.cpp reuses token_embd
    assert torch.equal(logits(back, batch), logits(model, batch))


@pytest.mark.parametrize("file_type, to_file, eps", [("f16", f16, 2**-10), ("bf16", bf16, 2**-7)])
def test_half_gguf_logits_are_the_rounded_models(stories, written, batch, file_type, to_file,
                                                 eps):
    """Exactly the logits of the model with its weights rounded to the file's type, so every
    tensor sits where llama.cpp expects it. Against the float32 model: rounding to nearest moves
    each weight by at most eps/2 of itself (eps: 2^-10 for f16's 10 mantissa bits, 2^-7 for
    bf16's 7), and through 5 layers the logits moved less than 2 eps of their largest (measured
    on stories260K: 0.012 of 17.5 for f16, 0.105 for bf16; printed); a misplaced or unpermuted
    tensor moves them by whole units."""
    model, _ = stories
    got = logits(read_back(written, f"stories-{file_type}.gguf"), batch)
    assert torch.equal(got, logits(rounded(model, to_file), batch))
    want = logits(model, batch)
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"{file_type}: max |logit diff| vs float32 = {diff:.3g} (max |logit| {scale:.3g})")
    assert 0 < diff < 2 * eps * scale


STRINGS = [
    "Once upon a time, there was a little girl named Lily.",
    "<s> Lily saw 12 birds and 345 cats.</s>",
    "</s> <s> héllo ☃ 𝔘 日本語 ünïcödé",
    "tabs\tand\nnewlines  and  spaces 3.14159",
    "byte fallback: € ∑ 🙂 and <unk> stay whole",
]


def test_stories_tokenizer_round_trips_through_the_gguf(stories, written):
    """The same ids with bos added, special tokens kept whole, bytes falling back alike.

    Text right after a special token with no space between (`<s>hi`) is left out: the file says
    add_space_prefix (llama.cpp then puts `▁` after every special token, as the original does),
    but transformers rebuilds a Metaspace with prepend_scheme="first" from any GGUF."""
    _, tokenizer = stories
    back = AutoTokenizer.from_pretrained(written, gguf_file="stories-f32.gguf")
    for text in STRINGS:
        assert back.encode(text) == tokenizer.encode(text), text
        assert back.decode(back.encode(text, add_special_tokens=False)) == \
            tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    assert tokenizer.encode("☃", add_special_tokens=False)[-3:] == [229, 155, 134]  # bytes
    assert back.chat_template == TEMPLATE


def fields(path) -> dict:
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}, reader


def test_metadata_and_tensor_table_are_llama_cpps(stories, written):
    model, tokenizer = stories
    meta, reader = fields(written / "stories-f16.gguf")
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "stories260K"
    assert meta["general.file_type"] == quants.FILE_TYPES["f16"][0]
    assert meta["tokenizer.chat_template"] == TEMPLATE
    assert {k: meta[f"llama.{k}"] for k in (
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
        "vocab_size")} == {
        "context_length": 512, "embedding_length": 64, "block_count": 5,
        "feed_forward_length": 172, "attention.head_count": 8, "attention.head_count_kv": 4,
        "rope.dimension_count": 8, "vocab_size": 512}
    assert meta["llama.rope.freq_base"] == 10000.0
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    assert [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown")] == [1, 2, 0]
    types = meta["tokenizer.ggml.token_type"]
    assert types[:3] == [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    assert types[3:259] == [TokenType.BYTE] * 256 and set(types[259:]) == {TokenType.NORMAL}
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    assert tokens == tokenizer.convert_ids_to_tokens(list(range(512)))
    # the first merges' pieces score highest, as in the SentencePiece model
    assert scores[259] > scores[260] > scores[265] > min(scores)
    table = {t.name: (t.tensor_type, [int(n) for n in t.shape]) for t in reader.tensors}
    assert "output.weight" not in table
    assert table["token_embd.weight"] == (Q.F16, [64, 512])  # GGUF lists columns first
    assert table["blk.4.ffn_down.weight"] == (Q.F16, [172, 64])
    assert table["blk.0.attn_k.weight"] == (Q.F16, [64, 32])
    assert table["blk.0.attn_norm.weight"] == (Q.F32, [64])
    assert table["output_norm.weight"] == (Q.F32, [64])
    assert len(table) == 2 + 9 * 5


def test_q8_0_is_refused_for_stories_before_anything_is_written(stories, tmp_path):
    model, tokenizer = stories
    path = tmp_path / "stories-q8_0.gguf"
    with pytest.raises(PipelineError) as err:
        write_model(model, tokenizer, path, "q8_0")
    message = str(err.value)
    assert "\n" not in message
    assert "blk.0.ffn_down.weight" in message and "172" in message and "32" in message
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_llama():
    """A random Llama whose rows fit q8_0's and the k-quants' blocks; untied head, vocab of
    the stories260K tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def test_q8_0_logits_of_a_model_it_fits(tiny_llama, stories, batch, tmp_path):
    """Exactly the logits of the model with q8_0-rounded weights. Against float32: q8_0 moves
    a weight by up to half a step, a 254th of its block of 32's largest |weight|, about 2^-7 of a
    typical (normal) weight; the logits moved less than 4 such steps of their largest (measured:
    0.018 of 1.42; printed)."""
    _, tokenizer = stories
    write_model(tiny_llama, tokenizer, tmp_path / "tiny.gguf", "q8_0")
    back = read_back(tmp_path, "tiny.gguf")
    assert not back.config.tie_word_embeddings
    got = logits(back, batch)
    assert torch.equal(got, logits(rounded(tiny_llama, q8_0), batch))
    want = logits(tiny_llama, batch)
    diff = (got - want).abs().max().item()
    print(f"q8_0: max |logit diff| vs float32 = {diff:.3g} (max |logit| "
          f"{want.abs().max().item():.3g})")
    assert 0 < diff < 4 * 2**-7 * want.abs().max().item()
    _, reader = fields(tmp_path / "tiny.gguf")
    table = {t.name: t.tensor_type for t in reader.tensors}
    assert table["output.weight"] == table["blk.1.ffn_down.weight"] == Q.Q8_0
    assert table["blk.1.ffn_norm.weight"] == Q.F32


@pytest.mark.parametrize("file_type", ["q4_k_m", "q6_k"])
def test_k_quant_logits_are_the_mixed_rounded_models(tiny_llama, stories, batch, tmp_path,
                                                       file_type):
    """A k-quant file reads back into exactly the logits of the model whose every tensor went
    through the type llama.cpp's mix gives it (q4_k_m: Q4_K, Q6_K for output and the
    more-bits layers' attn_v/ffn_down); the distance to float32 is printed."""
    _, tokenizer = stories
    write_model(tiny_llama, tokenizer, tmp_path / "tiny.gguf", file_type)
    got = logits(read_back(tmp_path, "tiny.gguf"), batch)
    family, n_layers = family_for(tiny_llama.config), tiny_llama.config.num_hidden_layers
    copy = type(tiny_llama)(tiny_llama.config).eval()
    state = {}
    for name, t in tiny_llama.state_dict().items():
        qtype = quants.tensor_type(file_type, family.gguf_name(name), tuple(t.shape), n_layers)
        w = t.numpy()
        state[name] = torch.from_numpy(
            gguf_quants.dequantize(quants.encode(w, qtype), qtype).reshape(w.shape)
            if t.dim() == 2 else w)
    copy.load_state_dict(state)
    assert torch.equal(got, logits(copy, batch))
    want = logits(tiny_llama, batch)
    diff = (got - want).abs().max().item()
    print(f"{file_type}: max |logit diff| vs float32 = {diff:.3g} (max |logit| "
          f"{want.abs().max().item():.3g})")
    # measured 0.261 (q4_k_m) and 0.0674 (q6_k) of 1.42: bounds ~1.4x that, as fractions
    assert 0 < diff < {"q4_k_m": 0.25, "q6_k": 0.07}[file_type] * want.abs().max().item()
    table = {t.name: t.tensor_type for t in fields(tmp_path / "tiny.gguf")[1].tensors}
    assert table["output.weight"] == Q.Q6_K
    if file_type == "q4_k_m":
        assert table["blk.0.attn_q.weight"] == Q.Q4_K


def test_non_finite_weights_are_refused_in_one_line(tiny_llama, stories, tmp_path):
    _, tokenizer = stories
    broken = type(tiny_llama)(tiny_llama.config).eval()
    broken.load_state_dict(tiny_llama.state_dict())
    with torch.no_grad():
        broken.model.layers[1].mlp.up_proj.weight[3, 7] = float("nan")
    with pytest.raises(PipelineError, match=r"^export.gguf: model.layers.1.mlp.up_proj.weight "
                                            r"holds NaN or inf values"):
        write_model(broken, tokenizer, tmp_path / "broken.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_another_architecture_is_refused_in_one_line(stories, tmp_path):
    _, tokenizer = stories
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=512,
                                      architectures=["GPT2LMHeadModel"]))
    with pytest.raises(PipelineError, match=r"^export.gguf: GPT2LMHeadModel cannot be written "
                                            r"as GGUF yet; supported: LlamaForCausalLM$"):
        write_model(gpt2, tokenizer, tmp_path / "gpt2.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_rope_scaling_is_written_or_refused():
    linear = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 10000.0})
    from gguf import GGUFWriter
    writer = GGUFWriter(None, "llama")
    family_for(linear).write_hparams(writer, linear)
    kv = {k: v.value for k, v in writer.kv_data[0].items()}
    assert kv["llama.rope.scaling.type"] == "linear" and kv["llama.rope.scaling.factor"] == 2.0
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                        "rope_theta": 10000.0})
    with pytest.raises(PipelineError, match=r"rope_type 'yarn' .* supported: default, linear$"):
        family_for(yarn)


def test_an_interrupted_write_leaves_the_old_file(stories, tmp_path, monkeypatch):
    """A failure after the header went out keeps whatever was at `path` and leaves no
    temporary file beside it."""
    model, tokenizer = stories
    path = tmp_path / "model.gguf"
    path.write_bytes(b"the previous export")
    calls = []

    def fail_on_third(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args)

    real = model_file._encoded
    monkeypatch.setattr(model_file, "_encoded", fail_on_third)
    with pytest.raises(OSError, match="disk full"):
        write_model(model, tokenizer, path, "f32")
    assert path.read_bytes() == b"the previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def byte_level_bpe(pre: str):
    """A tiny GPT-2-style tokenizer trained here: byte-level BPE, `<|endoftext|>` special."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    backend = Tokenizer(models.BPE())
    if pre == "gpt-2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # Llama 3's split rule, as transformers' GGUF loader spells it
        from transformers.integrations.gguf.gguf_tokenizer_mapping import \
            GGUF_PRE_TOKENIZER_SPLITS
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [line for _ in range(20) for line in STRINGS + [
        "The quick brown fox jumps over the lazy dog 1234567890.",
        "She said: 'we're here, they'll come' and it's done."]]
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_byte_level_bpe_tokenizer_round_trips(pre, tmp_path):
    tokenizer = byte_level_bpe(pre)
    n = len(tokenizer)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         vocab_size=n + 3))  # padded: 3 unused rows
    write_model(model, tokenizer, tmp_path / "bpe.gguf", "f32")
    meta, _ = fields(tmp_path / "bpe.gguf")
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == pre
    assert meta["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, n + 3)]
    assert meta["tokenizer.ggml.token_type"][0] == TokenType.CONTROL
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    for text in STRINGS + ["<|endoftext|>x<|endoftext|>", "  leading spaces, 2024 'll"]:
        assert back.encode(text, add_special_tokens=False) == \
            tokenizer.encode(text, add_special_tokens=False), text
        assert back.decode(back.encode(text, add_special_tokens=False)) == text


def test_other_tokenizers_are_refused_in_one_line(tiny_llama, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(PipelineError, match=r"^export.gguf: the tokenizer \(WordPiece model, "
                                            r"pre-tokenizer Whitespace\) cannot be written"):
        write_model(tiny_llama, wordpiece, tmp_path / "wp.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def test_sampling_defaults_are_written_when_the_run_samples(tiny_llama, stories, tmp_path):
    _, tokenizer = stories
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=40)
    write_model(tiny_llama, tokenizer, tmp_path / "sampled.gguf", "f32",
                generation_config=sampled, name="tiny")
    meta, _ = fields(tmp_path / "sampled.gguf")
    assert meta["general.name"] == "tiny"
    assert meta["general.sampling.temp"] == pytest.approx(0.7)
    assert meta["general.sampling.top_p"] == pytest.approx(0.9)
    assert meta["general.sampling.top_k"] == 40
    assert "tokenizer.chat_template" not in meta
    write_model(tiny_llama, tokenizer, tmp_path / "greedy.gguf", "f32",
                generation_config=GenerationConfig(do_sample=False))
    meta, _ = fields(tmp_path / "greedy.gguf")
    assert not [k for k in meta if k.startswith("general.sampling.")]


def test_a_tokenizer_larger_than_the_embedding_is_refused(stories, tmp_path):
    _, tokenizer = stories
    small = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=300))
    with pytest.raises(PipelineError, match=r"^export.gguf: the tokenizer has 512 tokens but "
                                            r"the model's embedding only 300 rows"):
        write_model(small, tokenizer, tmp_path / "small.gguf", "f32")
    assert list(tmp_path.iterdir()) == []
