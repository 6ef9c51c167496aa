"""The rollout's in-process generator (engine/rollout/local.py, sampling.py) against Hugging Face's
`generate` and logits processors (the oracles), on the shipped stories260K.

stories260K never samples its EOS (id 2) in the lengths used here, so the tests that need rows
to finish name a token it does emit (newline, "!") as the EOS.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT

from engine.rollout.generator import Completions, Generator, left_pad
from engine.rollout.local import LocalGenerator
from engine.rollout.sampling import SamplingParams, process_logits, token_presence

MODEL = ROOT / "data/models/stories260K"
PAD = 0  # the config's pad_token_id; the tokenizer has none
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The dog",
           "Tom and Sue went to the park. They played"]
T = 64


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompts(tok):
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS], PAD)
    assert len({int(m.sum()) for m in mask}) == 3  # three lengths: real left padding
    return ids, mask


def _hf(model, ids, mask, eos, **kw):
    """model.generate's completions (the prompt columns cut off)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=kw.pop("T", T),
                         pad_token_id=PAD, eos_token_id=eos, **kw)
    return out[:, ids.shape[1]:]


def _greedy(model, ids, mask, eos, steps=T):
    params = SamplingParams(steps, temperature=0)
    return LocalGenerator(model, params, eos, PAD).generate(ids, mask, 1, seed=0)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], PAD)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("eos_tokens", [["</s>"], ["</s>", "."]])
def test_greedy_equals_hf_generate(model, tok, prompts, eos_tokens, penalty):
    """Token for token, finished rows included: HF pads them and stops when all rows are done;
    the generator pads them and trims to the longest completion."""
    ids, mask = prompts
    eos = tok.convert_tokens_to_ids(eos_tokens)
    expected = _hf(model, ids, mask, eos, do_sample=False, repetition_penalty=penalty)
    gen = LocalGenerator(model, SamplingParams(T, temperature=0, repetition_penalty=penalty),
                         eos, PAD)
    got = gen.generate(ids, mask, num_generations=1, seed=0)
    assert isinstance(gen, Generator)
    assert torch.equal(got.ids, expected)
    if len(eos) > 1:  # rows stopped at different steps, none ran to T
        assert expected.shape[1] < T and len(set(got.lengths.tolist())) == 3
        assert not got.clipped.any()


def test_absolute_positions_equal_hf_generate():
    """A model with learned absolute positions (a random tiny GPT-2) sees the positions the mask
    gives (RoPE's relative positions would forgive an offset by the padding; these do not)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=32, n_layer=2,
                                      n_head=4, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=PAD)).eval()
    ids, mask = left_pad([[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33]], PAD)
    expected = _hf(gpt2, ids, mask, [2], do_sample=False, T=20)
    got = _greedy(gpt2, ids, mask, [2], 20)
    assert torch.equal(got.ids, expected)


SAMPLING = [
    {},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2},
    {"temperature": 1.3, "min_p": 0.05},
    {"top_p": 0.6},
]


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: ",".join(kw) or "defaults")
def test_sampling_equals_hf_generate_with_the_same_seed(model, tok, prompts, kw):
    """The same processors and the same multinomial draws as HF's sampling after
    torch.manual_seed(seed), and num_return_sequences' row order (prompt 0's rows first)."""
    ids, mask = prompts
    eos = [tok.convert_tokens_to_ids("<0x0A>")]
    torch.manual_seed(123)
    expected = _hf(model, ids, mask, eos, do_sample=True, num_return_sequences=4, **kw)
    got = LocalGenerator(model, SamplingParams(T, **kw), eos, PAD).generate(ids, mask, 4, 123)
    assert got.ids.shape == (12, expected.shape[1])
    assert torch.equal(got.ids, expected)


def _hf_processors(kw, ignore=None):
    from transformers import (LogitsProcessorList, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    procs = []
    if kw.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"],
                                                      prompt_ignore_length=ignore))
    if kw.get("temperature", 1.0) != 1.0:
        procs.append(TemperatureLogitsWarper(kw["temperature"]))
    if kw.get("top_k", 0):
        procs.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(kw["top_p"]))
    if kw.get("min_p") is not None:
        procs.append(MinPLogitsWarper(kw["min_p"]))
    return LogitsProcessorList(procs)


PROCESSING = [
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.7},
    {"temperature": 0.5},
    {"top_k": 7},
    {"top_p": 0.5},
    {"min_p": 0.2},
    {"repetition_penalty": 1.3, "temperature": 0.7, "top_k": 50, "top_p": 0.8},
    {"repetition_penalty": 1.3, "temperature": 1.7, "top_k": 500, "top_p": 0.95, "min_p": 0.1},
]


@pytest.mark.parametrize("kw", PROCESSING,
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_processing_equals_hf_logits_processors(kw):
    """The same -inf positions and the same finite scores as HF's processors, for random logits
    and left-padded token ids (the penalty skips the padding, as HF generate tells its
    processor with prompt_ignore_length)."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows, width = 512, 6, 20
    logits = torch.randn(rows, vocab, generator=gen) * 3
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[4, :19] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    padding = (mask != 0).int().argmax(dim=1)
    expected = _hf_processors(kw, ignore=padding)(ids, logits.clone())
    got = process_logits(logits, SamplingParams(8, **kw), token_presence(ids, mask, vocab))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=0)
    assert not torch.equal(got, logits)  # the setting did something
    if "repetition_penalty" in kw:  # the padding is not penalised: PAD is in no real token
        penalty_only = SamplingParams(8, repetition_penalty=kw["repetition_penalty"])
        penalised = process_logits(logits, penalty_only, token_presence(ids, mask, vocab))
        assert not (ids[1, 5:] == PAD).any() and penalised[1, PAD] == logits[1, PAD]
        assert penalised[1, ids[1, 5]] != logits[1, ids[1, 5]]


def test_temperature_zero_keeps_the_penalty_and_nothing_else():
    logits = torch.randn(2, 16)
    ids = torch.tensor([[3, 4], [5, 5]])
    params = SamplingParams(4, temperature=0, top_k=1, top_p=0.1, repetition_penalty=2.0)
    got = process_logits(logits, params, token_presence(ids, torch.ones_like(ids), 16))
    expected = _hf_processors({"repetition_penalty": 2.0})(ids, logits.clone())
    assert torch.equal(got, expected)


def test_seed_reproduces_bitwise_and_another_seed_differs(model, prompts):
    ids, mask = prompts
    gen = LocalGenerator(model, SamplingParams(T, top_p=0.95), [2], PAD)
    a, b = gen.generate(ids, mask, 3, seed=7), gen.generate(ids, mask, 3, seed=7)
    c = gen.generate(ids, mask, 3, seed=8)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.ids, c.ids)
    # the num_generations of one prompt are different samples
    assert len({tuple(r) for r in a.ids[:3].tolist()}) == 3


def test_rows_are_grouped_by_prompt(model, prompts):
    """Rows g*G .. g*G + G-1 continue prompt g (top_k=1: sampling that can only pick the
    argmax, so every row equals its prompt's greedy completion)."""
    ids, mask = prompts
    greedy = _greedy(model, ids, mask, [])
    assert len({tuple(r) for r in greedy.ids.tolist()}) == 3
    got = LocalGenerator(model, SamplingParams(T, top_k=1), [], PAD).generate(ids, mask, 3, 5)
    assert torch.equal(got.ids, greedy.ids.repeat_interleave(3, dim=0))


def test_mask_lengths_and_clipped(model, tok, prompts):
    """mask is 1 up to and including the first EOS and 0 after, ids are pad after it; a row
    without EOS is clipped and its mask is all 1. The expectation comes from a run without EOS."""
    ids, mask = prompts
    free = _greedy(model, ids, mask, [])
    bang = tok.convert_tokens_to_ids("!")
    first = [r.index(bang) if bang in r else None for r in free.ids.tolist()]
    assert any(f is None for f in first) and any(f is not None for f in first)  # the setup holds
    got = _greedy(model, ids, mask, [bang])
    assert isinstance(got, Completions) and got.ids.shape == got.mask.shape == (3, T)
    for row, f in enumerate(first):
        n = T if f is None else f + 1
        assert got.mask[row].tolist() == [1] * n + [0] * (T - n)
        assert got.ids[row].tolist() == free.ids[row, :n].tolist() + [PAD] * (T - n)
        assert got.lengths[row] == n
        assert bool(got.clipped[row]) == (f is None)


def test_trimmed_to_the_longest_completion(model, tok, prompts):
    ids, mask = prompts
    newline = tok.convert_tokens_to_ids("<0x0A>")
    got = _greedy(model, ids, mask, [newline])
    assert got.ids.shape[1] == int(got.lengths.max()) < T
    assert (got.ids[got.mask == 1] == newline).sum() == 3


@pytest.mark.parametrize("batch_size,check", [(4, None), (None, 16), (2, 5)])
def test_chunks_and_stop_checks_do_not_change_greedy_completions(model, tok, prompts, batch_size,
                                                                  check):
    """Chunks of rows (each dropping the padding all its rows share) and a stop check every
    `check` tokens (the CUDA loop's) give the completions of one batch checking every token."""
    ids, mask = prompts
    eos = [tok.convert_tokens_to_ids("<0x0A>")]
    params = SamplingParams(96, temperature=0, repetition_penalty=1.2)
    whole = LocalGenerator(model, params, eos, PAD).generate(ids, mask, 2, 0)
    assert whole.ids.shape[1] < 96 - 16  # every row finished early: a later check runs longer
    got = LocalGenerator(model, params, eos, PAD, batch_size=batch_size,
                         stop_check_every=check).generate(ids, mask, 2, 0)
    for field in ("ids", "mask", "lengths", "clipped"):
        assert torch.equal(getattr(got, field), getattr(whole, field)), field


def test_under_autocast_it_equals_hf_generate(model, prompts):
    """The caller's autocast applies to the forwards (bf16 logits), the scores are float32."""
    ids, mask = prompts
    dtypes = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = LocalGenerator(model, SamplingParams(T, top_k=20), [2], PAD).generate(
                ids, mask, 1, 0)
    finally:
        hook.remove()
    assert set(dtypes) == {torch.bfloat16} and len(dtypes) == T
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _hf(model, ids, mask, [2], do_sample=True, top_k=20)
    assert torch.equal(got.ids, expected)


def test_through_peft_lora_in_train_mode(prompts):
    """A LoRA-wrapped model in train mode, with gradient checkpointing and use_cache=False as in
    training: generation runs in eval mode (dropout 0.5 would otherwise change the greedy
    tokens), equals HF generate through the same PeftModel in eval mode, leaves every module's
    mode as it was, and its completions feed a training forward and backward."""
    from peft import LoraConfig, get_peft_model

    base = _model()
    base.gradient_checkpointing_enable()
    base.config.use_cache = False
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                 target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    ids, mask = prompts
    expected = _hf(peft_model.eval(), ids, mask, [2], do_sample=False, use_cache=True)
    with peft_model.disable_adapter():
        assert not torch.equal(expected, _hf(peft_model, ids, mask, [2], do_sample=False,
                                             use_cache=True))  # the adapter changes tokens

    peft_model.train()
    frozen = peft_model.get_base_model().model.norm
    frozen.eval()  # one module left in eval mode inside a model in train mode
    modes = {name: m.training for name, m in peft_model.named_modules()}
    got = _greedy(peft_model, ids, mask, [2])
    assert torch.equal(got.ids, expected)
    assert {name: m.training for name, m in peft_model.named_modules()} == modes
    assert peft_model.training and not frozen.training

    full = torch.cat([ids, got.ids], dim=1)
    attention = torch.cat([mask, got.mask], dim=1)
    assert not got.ids.requires_grad and not got.ids.is_inference()
    peft_model(input_ids=full, attention_mask=attention).logits.sum().backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None for g in grads)


@pytest.mark.parametrize("bad", [
    {"max_completion_length": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0},
])
def test_sampling_params_refuse_nonsense(bad):
    with pytest.raises(ValueError):
        SamplingParams(**({"max_completion_length": 8} | bad))


def test_the_preallocated_cache_gives_the_dynamic_caches_logits_bitwise(model, prompts):
    """engine/rollout/kv_cache.py: keys and values written in place into buffers sized once
    give the logits of Hugging Face's DynamicCache (torch.cat per token), bitwise, through a
    padded prefill and ten decode steps; the cache repeats rows as DynamicCache does."""
    from transformers.cache_utils import DynamicCache

    from engine.rollout.kv_cache import PreallocatedLayer, preallocated_cache

    ids, mask = prompts
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=model.config), preallocated_cache(model.config,
                                                                    ids.shape[1] + 10)]
    assert all(isinstance(layer, PreallocatedLayer) for layer in caches[1].layers)
    logits = []
    with torch.no_grad():
        for cache in caches:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(2)
            steps, attention = [out.logits[:, -1]], mask.repeat_interleave(2, 0)
            token, position = out.logits[:, -1].argmax(-1).repeat_interleave(2, 0)[:, None], \
                positions[:, -1:].repeat_interleave(2, 0) + 1
            for _ in range(10):
                attention = torch.cat([attention, torch.ones_like(token)], dim=1)
                out = model(input_ids=token, attention_mask=attention, position_ids=position,
                            past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1])
                token, position = out.logits[:, -1].argmax(-1)[:, None], position + 1
            logits.append(steps)
    assert caches[1].get_seq_length() == ids.shape[1] + 10
    for dynamic, preallocated in zip(*logits):
        assert torch.equal(dynamic, preallocated)
    with pytest.raises(ValueError, match="holds"):  # one position past its capacity
        caches[1].layers[0].update(torch.zeros(6, 4, 1, 8), torch.zeros(6, 4, 1, 8))


def test_a_shared_prefill_draws_what_one_prefill_per_row_draws(model, prompts):
    """Each prompt is prefilled once and its cache repeated for its completions (the default);
    with share_prefill=False every row is prefilled, as HF generate does. The first scores
    agree to float32 rounding (a 1-row and a G-row matmul may round differently), and on these
    prompts the sampled completions are the same tokens; a chunk that splits a group (batch
    size 3, G 2) prefills per row and draws the same."""
    ids, mask = prompts
    params = SamplingParams(T, top_k=50)
    runs = {share: LocalGenerator(model, params, [2], PAD, share_prefill=share).generate(
        ids, mask, 4, [7, 8, 9]) for share in (True, False)}
    for field in ("ids", "mask", "lengths", "clipped"):
        assert torch.equal(getattr(runs[True], field), getattr(runs[False], field)), field
    split = LocalGenerator(model, SamplingParams(T, temperature=0), [2], PAD, batch_size=3)
    whole = LocalGenerator(model, SamplingParams(T, temperature=0), [2], PAD)
    assert torch.equal(split.generate(ids, mask, 2, 0).ids, whole.generate(ids, mask, 2, 0).ids)
    forwards = []  # the embedding sees every forward's tokens, the model's or the lean step's
    hook = model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: forwards.append(args[0].shape))
    try:
        LocalGenerator(model, SamplingParams(2), [2], PAD).generate(ids, mask, 4, [1, 2, 3])
    finally:
        hook.remove()
    assert forwards[0][0] == 3 and forwards[1] == (12, 1)  # 3 prompts prefilled, 12 rows decoded


def test_finished_rows_leave_the_forwards_and_the_others_draw_the_same(model, tok, prompts):
    """Rows that emitted EOS leave the decode forwards once they are a quarter of the rows
    still generating (their cache rows dropped); the draws stay full-size, so every other row
    samples the tokens it samples with drop_finished=False, and with one seed for the call
    (whose stream every row shares) too."""
    ids, mask = prompts
    eos = [tok.convert_tokens_to_ids("<0x0A>"), tok.convert_tokens_to_ids("!")]
    params = SamplingParams(96, top_k=50)
    for seed in ([4, 5, 6], 3):
        rows = {}
        for drop in (True, False):
            seen = []
            hook = model.get_input_embeddings().register_forward_hook(
                lambda mod, args, out: seen.append(args[0].shape[0]))
            try:
                rows[drop] = LocalGenerator(model, params, eos, PAD, drop_finished=drop
                                            ).generate(ids, mask, 4, seed)
            finally:
                hook.remove()
            rows[drop, "forwards"] = seen
        for field in ("ids", "mask", "lengths", "clipped"):
            assert torch.equal(getattr(rows[True], field), getattr(rows[False], field)), field
        lengths = rows[True].lengths
        assert lengths.min() < lengths.max() - 8  # rows finished at different times
        assert set(rows[False, "forwards"][1:]) == {12}
        decoded = rows[True, "forwards"][1:]
        assert decoded[-1] < 12 and decoded == sorted(decoded, reverse=True), decoded
        assert sum(decoded) < sum(rows[False, "forwards"][1:])


def _tiny_qwen2_with_lora():
    """A randomly initialised Qwen2 (biased q/k/v projections, 2 query heads per key/value
    head) under an unmerged peft LoRA whose B is not zero: the lean step calls the LoRA layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=PAD)
    config._attn_implementation = "sdpa"
    base = Qwen2ForCausalLM(config).eval()
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear",
                                           init_lora_weights=False)).eval()


@pytest.mark.parametrize("which", ["stories260K", "qwen2+lora"])
@pytest.mark.parametrize("padded", [True, False])
def test_the_lean_decode_step_gives_the_forwards_logits_bitwise(model, prompts, which, padded):
    """engine/rollout/lean_decode.py: after the same prefill, ten decode steps through the lean
    step give the model forward's logits bitwise (grouped-query attention with and without a
    padding mask, biases, LoRA layers), rows repeated as the shared prefill repeats them."""
    from engine.rollout.kv_cache import preallocated_cache
    from engine.rollout.lean_decode import lean_decoder

    net = model if which == "stories260K" else _tiny_qwen2_with_lora()
    ids, mask = prompts
    if not padded:
        ids, mask = ids[:, -2:], mask[:, -2:]
        assert bool(mask.all())
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = ids.shape[1] + 10
    caches = [preallocated_cache(net.config, width) for _ in range(2)]
    lean = lean_decoder(net, caches[1], width)
    assert lean is not None
    with torch.no_grad():
        for cache in caches:
            first = net(input_ids=ids, attention_mask=mask if padded else None,
                        position_ids=positions, past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(2)
        attention = mask.repeat_interleave(2, 0)
        token = first.logits[:, -1].argmax(-1).repeat_interleave(2, 0)[:, None]
        position = positions[:, -1:].repeat_interleave(2, 0) + 1
        for _ in range(10):
            attention = torch.cat([attention, torch.ones_like(token)], dim=1)
            expected = net(input_ids=token, attention_mask=attention if padded else None,
                           position_ids=position, past_key_values=caches[0],
                           use_cache=True).logits[:, -1].float()
            got = lean.step(token, attention if padded else None, position)
            assert torch.equal(got, expected)
            token, position = expected.argmax(-1)[:, None], position + 1
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == width


def test_the_generator_draws_the_same_with_and_without_the_lean_step(model, tok, prompts):
    """Sampled completions, rows finishing at different times and leaving the forwards: every
    field equal with lean_decode on and off; where the lean step does not apply (eager
    attention) it is not used."""
    from engine.rollout.kv_cache import preallocated_cache
    from engine.rollout.lean_decode import lean_decoder
    from transformers import AutoModelForCausalLM

    ids, mask = prompts
    eos = [tok.convert_tokens_to_ids("<0x0A>"), tok.convert_tokens_to_ids("!")]
    params = SamplingParams(96, top_k=50)
    runs = [LocalGenerator(model, params, eos, PAD, lean_decode=lean).generate(
        ids, mask, 4, [4, 5, 6]) for lean in (True, False)]
    for field in ("ids", "mask", "lengths", "clipped"):
        assert torch.equal(getattr(runs[0], field), getattr(runs[1], field)), field
    assert runs[0].lengths.min() < runs[0].lengths.max()
    eager = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager")
    assert lean_decoder(eager, preallocated_cache(eager.config, 8), 8) is None
    assert lean_decoder(model, None, 8) is None  # a cache the model builds itself


def test_a_draw_is_torch_multinomials_without_its_host_sync():
    """next_tokens draws what torch.multinomial(probs, 1) draws from the same generator state,
    one generator for all rows or one per span of rows, and still refuses a NaN score."""
    from engine.rollout.sampling import next_tokens

    scores = torch.randn(12, 300) * 3
    params = SamplingParams(4)
    probs = scores.softmax(-1)

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    expected = torch.multinomial(probs, 1, generator=seeded(5)).squeeze(1)
    assert torch.equal(next_tokens(scores, params, seeded(5)), expected)
    spans = [(0, 4, seeded(1)), (4, 12, seeded(2))]
    expected = torch.cat([torch.multinomial(probs[a:b], 1, generator=seeded(s)).squeeze(1)
                          for (a, b, _), s in zip(spans, (1, 2))])
    assert torch.equal(next_tokens(scores, params, spans), expected)
    with pytest.raises(RuntimeError, match="nan"):
        next_tokens(scores.index_fill(1, torch.tensor([7]), float("nan")), params, seeded(1))


class _EvalTokenizer:
    """What greedy_generate reads of a tokenizer: pad and EOS ids, and decode."""

    def __init__(self, tok, eos: int):
        self.pad_token_id, self.eos_token_id, self._tok = PAD, eos, tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _generate_texts(model, tok, prompts: list[list[int]], batch_size: int, steps: int):
    """The oracle: Hugging Face generate, greedy, on the same left-padded batches, decoded as
    the evaluate stage decodes (cut at the first EOS)."""
    texts = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start:start + batch_size], PAD)
        out = _hf(model, ids, mask, tok.eos_token_id, T=steps, do_sample=False)
        for row in out.tolist():
            row = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
            texts.append(tok.decode(row))
    return texts


@pytest.mark.parametrize("which", ["stories260K+lora", "qwen2+lora"])
def test_the_evaluate_stages_greedy_texts_are_generates_without_calling_it(tok, which):
    """engine/rollout/greedy.py: for a Llama-family model the evaluate stage's greedy texts
    come from the rollout room's generator (the lean decode step, adapters unfolded) and equal
    Hugging Face generate's, chunk by chunk (uneven prompt lengths, a last chunk of one row,
    rows that finish early and rows that run to the limit); generate itself is not called."""
    from peft import LoraConfig, get_peft_model

    from engine.rollout.greedy import greedy_generate

    if which == "qwen2+lora":
        net = _tiny_qwen2_with_lora()
    else:
        torch.manual_seed(0)
        net = get_peft_model(_model(), LoraConfig(r=4, target_modules="all-linear",
                                                  init_lora_weights=False)).eval()
    prompts = [tok(p)["input_ids"] for p in PROMPTS + ["Lily", "One day a big bird"]]
    steps = 24
    # an EOS the model emits in the middle of some rows and not others
    first = _generate_texts(net, _EvalTokenizer(tok, PAD), prompts, 5, steps)
    emitted = tok(first[0])["input_ids"][1:]
    eos_tok = _EvalTokenizer(tok, emitted[len(emitted) // 2])
    expected = _generate_texts(net, eos_tok, prompts, 2, steps)
    assert len({len(t) for t in expected}) > 1, expected

    def refuse(*args, **kwargs):
        raise AssertionError("generate was called")

    net.generate = refuse
    got = greedy_generate(net, eos_tok, prompts, batch_size=2, max_new_tokens=steps)
    assert got == expected


def test_a_model_whose_generation_config_processes_logits_keeps_generate(model):
    """A repetition penalty (or any other logits setting) in the model's own generation config
    is applied by generate, which the evaluate stage then keeps."""
    import copy

    from engine.rollout.greedy import _local_generator

    assert _local_generator(model, 8, eos=2, pad=PAD) is not None
    penalised = copy.deepcopy(model)
    penalised.generation_config.repetition_penalty = 1.1
    assert _local_generator(penalised, 8, eos=2, pad=PAD) is None
    # a wrapper with its own generate (in-training evaluation over ranks: every rank keeps
    # running forwards until all finished) keeps its generate, whatever it wraps
    from engine.recipe.sft.in_training import _SyncedGenerate

    assert _local_generator(_SyncedGenerate(model), 8, eos=2, pad=PAD) is None
