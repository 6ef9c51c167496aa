"""Rollouts on a vLLM server (`grpo.use_vllm`, engine/rollout/vllm_server.py) and TRL's
importance-sampling correction, over real HTTP on 127.0.0.1: the server is tests/rollout_server.py,
vLLM's OpenAI-compatible surface (/v1/models, /v1/completions with token-id prompts, n, seed and
logprobs, /v1/load_lora_adapter) over our own LocalGenerator, since vLLM needs a GPU; nothing
of the network is mocked.

(a) the generator over HTTP returns the completions LocalGenerator draws with the same weights
    and seeds, bitwise, and the server's log-probabilities within float rounding of the
    model's own; the adapter it is sent changes what it samples;
(b) the importance-sampling ratio, its masks, the loss it multiplies and the logged statistics
    equal TRL's GRPOTrainer's own code path for each of the 4 modes (TRL's vLLM branch of
    _generate_and_score_completions and _compute_loss, fed the same completions and sampler
    log-probabilities);
(c) a short GRPO run over HTTP (adapter synced before each rollout) trains to the rewards the
    local generator's run gets, and logs TRL's sampling/* statistics;
(d) a server that does not answer stops the train stage before any training, one line naming
    grpo.vllm_server_base_url and the URL; a server without the runtime LoRA API is one line
    too.
"""

from __future__ import annotations

import copy
import csv
import socket
from pathlib import Path

import pytest
import torch

from helpers import ROOT

MODEL = ROOT / "data" / "models" / "stories260K"
TEXTS = ("Once upon a time", "Tom had a big red ball and a small dog", "The cat")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    return model, tok


# -- (a) the generator over HTTP --------------------------------------------------------------

def test_the_server_generates_what_the_local_generator_does(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model
    from rollout_server import RolloutServer

    from engine.recipe.grpo.loss import completion_logps
    from engine.rollout.generator import left_pad
    from engine.rollout.local import LocalGenerator, eos_ids
    from engine.rollout.sampling import SamplingParams
    from engine.rollout.vllm_server import VLLMServerGenerator

    model, tok = tiny
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    policy.save_pretrained(str(tmp_path / "adapter"))
    ids, mask = left_pad([tok(t)["input_ids"] for t in TEXTS], 0)
    params = SamplingParams(max_completion_length=16, temperature=0.9, top_k=50)
    # "." ends a completion too, here and not on the server (it stops at EOS only): the
    # generator cuts the server's rows after the first of its own EOS ids, as it must
    eos, seeds = eos_ids(tok, model) + [tok.convert_tokens_to_ids(".")], [11, 22, 33]
    with RolloutServer(MODEL) as server:
        http = VLLMServerGenerator(server.url, params, eos, 0, timeout=5)
        from_base = http.generate(ids, mask, 4, seeds)
        http.load_adapter("policy-1", tmp_path / "adapter")
        got = http.generate(ids, mask, 4, seeds)
        last = tok(TEXTS[2])["input_ids"]
        sent = [r for r in server.requests if r["prompt"] == last][-1]
        assert len(server.requests) == 6  # one per prompt per call
    local = LocalGenerator(policy, params, eos, 0).generate(ids, mask, 4, seeds)
    base = LocalGenerator(model, params, eos, 0).generate(ids, mask, 4, seeds)

    for ours, theirs in ((got, local), (from_base, base)):
        assert torch.equal(ours.ids, theirs.ids)
        assert torch.equal(ours.mask, theirs.mask)
        assert torch.equal(ours.lengths, theirs.lengths)
        assert torch.equal(ours.clipped, theirs.clipped)
    assert not torch.equal(got.ids, from_base.ids)  # the adapter reached the server
    clipped = torch.cat([got.clipped, from_base.clipped])
    assert clipped.any() and (~clipped).any()  # ended by EOS, and clipped
    # one request per prompt with its own seed, token ids in, log-probs of the sampled tokens
    assert (sent["model"], sent["n"], sent["seed"], sent["logprobs"]) == ("policy-1", 4, 33, 0)
    assert sent["return_tokens_as_token_ids"] and sent["top_k"] == 50
    assert sent["temperature"] == 0.9 and sent["max_tokens"] == 16
    assert local.sampling_logps is None

    full = torch.cat([ids.repeat_interleave(4, 0), local.ids], 1)
    attention = torch.cat([mask.repeat_interleave(4, 0), local.mask], 1)
    with torch.no_grad():
        own = completion_logps(policy, full, attention, local.ids.shape[1], 0.9)[0]
    m = local.mask.bool()
    difference = (own - got.sampling_logps)[m].abs().max()
    # the generation folds the adapters into the weights: float rounding, not a mismatch
    assert float(difference) < 1e-4, float(difference)
    assert (got.sampling_logps[m] < 0).all() and (got.sampling_logps[~m] == 0).all()


# -- (b) the correction against TRL's code path ----------------------------------------------

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("mode", MODES)
def test_the_importance_sampling_ratio_loss_and_statistics_equal_trls(tiny, tmp_path, mode):
    """TRL's GRPOTrainer with its vLLM branch on (use_vllm and the correction set on the
    trainer: its generation injected, as tests/test_grpo_trl.py does, returning completions
    and sampler log-probabilities): its importance_sampling_ratio, sampling/* statistics and
    _compute_loss equal ours on the same inputs. The sampler's log-probabilities are the
    model's own plus seeded noise (one token NaN, as vLLM can return), so the bounds
    [0.7, 1.5] both act."""
    from test_grpo_trl import GROUP, LENGTH, PROMPTS, TEMPERATURE, trl_trainer

    from engine.recipe.grpo.loss import (SAMPLING_STATS, Objective, SamplingCorrection,
                                         completion_logps, importance_sampling_ratio, reduce,
                                         sampling_stats, token_losses)

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    if tok.pad_token is None:
        tok = copy.deepcopy(tok)
        tok.pad_token = tok.eos_token
    trainer = trl_trainer(tmp_path, model, tok, "dapo", 0.0, 1,
                          vllm_importance_sampling_mode=mode,
                          vllm_importance_sampling_clip_min=0.7,
                          vllm_importance_sampling_clip_max=1.5)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = trainer.state.global_step  # no weights to send
    injected = list(trainer.injected)
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]

    def scored(logprobs):
        trainer._generate_single_turn = lambda *a, **k: (
            [list(ids) for ids in injected], [list(lp) for lp in logprobs])
        return trainer._generate_and_score_completions(inputs)

    first = scored([[0.0] * len(ids) for ids in injected])
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(first["old_per_token_logps"].shape, generator=g) * 0.35
    sampler = (first["old_per_token_logps"] + noise)
    logprobs = [sampler[i, :len(ids)].tolist() for i, ids in enumerate(injected)]
    logprobs[1][1] = None  # a token vLLM gave no log-probability
    trainer._metrics["train"].clear()
    out = scored(logprobs)
    metrics = trainer._metrics["train"]

    mask = out["completion_mask"]
    ours_sampling = out["sampling_per_token_logps"].clone()
    assert torch.isnan(ours_sampling[1, 1])
    correction = SamplingCorrection(mode, 0.7, 1.5)
    ratio = importance_sampling_ratio(out["old_per_token_logps"], ours_sampling, mask,
                                      correction)
    theirs = out["importance_sampling_ratio"]
    assert ratio.shape == theirs.shape == ((mask.shape[0], 1) if mode.startswith("sequence")
                                           else mask.shape)
    torch.testing.assert_close(ratio, theirs, atol=1e-6, rtol=0)
    acted = ratio[mask.bool()] if not correction.per_sequence else ratio
    if mode.endswith("mask"):
        assert (acted == 0).any() and (acted > 0).any()  # some masked, some kept
    else:
        assert (acted == 0.7).any() and (acted == 1.5).any()  # both bounds clamp
    stats = sampling_stats([out["old_per_token_logps"]], [ours_sampling], [ratio], [mask],
                           correction.per_sequence)
    for name, value in zip(SAMPLING_STATS, stats.tolist()):
        assert value == pytest.approx(metrics[name][-1], abs=1e-6), name

    # the loss: TRL multiplies the per-token loss by the ratio
    policy = trainer.model
    args = trainer.args
    from types import SimpleNamespace

    objective = Objective.of(SimpleNamespace(**vars(args), clip_high=args.epsilon_high))
    theirs_loss = trainer._compute_loss(policy, out)
    input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], mask], 1)
    logps = completion_logps(policy, input_ids, attention, mask.shape[1], TEMPERATURE)[0]
    losses = token_losses(logps, out["old_per_token_logps"], None, out["advantages"], mask,
                          objective, is_ratio=ratio, sampling_logps=ours_sampling)
    total, count = reduce("dapo", losses.per_token, mask, LENGTH)
    # float noise of TRL's tiled LM head, as in tests/test_grpo_trl.py
    assert float(total / count) == pytest.approx(float(theirs_loss), abs=1e-5)
    plain = token_losses(logps, out["old_per_token_logps"], None, out["advantages"], mask,
                         objective)
    plain_loss = reduce("dapo", plain.per_token, mask, LENGTH)
    assert abs(float(plain_loss[0] / plain_loss[1]) - float(theirs_loss)) > 1e-4


# -- (c) a GRPO run over HTTP -------------------------------------------------------------------

#: the shipped GRPO example, shrunk (as tests/test_grpo.py shrinks it), 4 steps
SHRUNK = {"data.max_train_samples": 32, "data.max_eval_samples": 8,
          "data.max_seq_length": 256, "training.max_steps": 4,
          "training.per_device_train_batch_size": 4, "grpo.num_generations": 4,
          "grpo.max_completion_length": 16, "grpo.format_regex": "!",
          "optimizer.learning_rate": 0.005, "scheduler.warmup_steps": 0,
          "logging.logging_steps": 1, "checkpoint.save_strategy": "no",
          "eval.eval_strategy": "no", "eval.max_generation_samples": 8}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    from helpers import ON_STORIES, prepared_example

    return prepared_example(tmp_path_factory.mktemp("vllm") / "p", "params/grpo-gsm8k.yaml",
                            SHRUNK, *ON_STORIES)


def _rows(project: Path) -> list[dict]:
    with open(project / "data/plots/train.csv") as fh:
        return list(csv.DictReader(fh))


def test_a_grpo_run_over_http_trains_to_the_local_runs_rewards(prompts, tmp_path):
    from helpers import train_here
    from rollout_server import RolloutServer

    local, _ = train_here(prompts, tmp_path / "local")
    with RolloutServer(MODEL) as server:
        served, out = train_here(prompts, tmp_path / "http", {
            "grpo.use_vllm": True, "grpo.vllm_server_base_url": server.url,
            "grpo.vllm_server_timeout": 10})
    # one adapter per rollout (4 steps), each prompt one request with its seed
    assert len(server.loaded) == 4 and len(set(server.loaded)) == 4, server.loaded
    assert len(server.requests) == 4 * 4
    assert "rollouts on the vLLM server at" in out.stdout
    ours, theirs = _rows(served), _rows(local)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        for name in ("reward", "reward_std", "rewards/format/mean",
                     "completions/mean_length", "completions/clipped_ratio"):
            assert float(a[name]) == pytest.approx(float(b[name]), abs=1e-6), (name, a, b)
        assert "sampling/importance_sampling_ratio/mean" not in b
        # the server's log-probabilities differ from the training forward's by rounding
        assert 0 <= float(a["sampling/sampling_logp_difference/mean"]) < 1e-4
        assert float(a["sampling/sampling_logp_difference/max"]) < 1e-3
        for stat in ("min", "mean", "max"):
            assert float(a[f"sampling/importance_sampling_ratio/{stat}"]) == pytest.approx(
                1.0, abs=1e-3)
    assert [float(r["reward"]) for r in ours] != [0.0] * 4  # something was learned from
    # the ratio is 1 within rounding, so the loss is the local run's
    assert float(ours[-1]["loss"]) == pytest.approx(float(theirs[-1]["loss"]), abs=1e-4)


# -- (d) refusals ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_stops_the_train_stage_before_training(prompts, tmp_path):
    import shutil

    from helpers import refused_here, write_params

    project = tmp_path / "p"
    shutil.copytree(prompts, project, symlinks=True)
    url = f"http://127.0.0.1:{_free_port()}"
    write_params(project, {"grpo.use_vllm": True, "grpo.vllm_server_base_url": url,
                           "grpo.vllm_server_timeout": 1})
    line = refused_here(project, "train")
    assert line.startswith(f"grpo.vllm_server_base_url {url}: no vLLM server answered"), line
    assert "within 1 s" in line and "vllm serve" in line
    assert not (project / "data/plots/train.csv").exists()
    assert not (project / "data/trained").exists() or not any(
        (project / "data/trained").iterdir())


def test_a_server_without_the_runtime_lora_api_is_one_line(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model
    from rollout_server import RolloutServer

    from engine.rollout.sampling import SamplingParams
    from engine.rollout.vllm_server import VLLMServerGenerator
    from finetune.errors import PipelineError

    policy = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=2, target_modules="all-linear"))
    policy.save_pretrained(str(tmp_path / "a"))
    with RolloutServer(MODEL, runtime_lora=False) as server:
        http = VLLMServerGenerator(server.url, SamplingParams(max_completion_length=4), [2], 0,
                                   key="rloo.vllm_server_base_url", timeout=5)
        with pytest.raises(PipelineError) as refused:
            http.load_adapter("p", tmp_path / "a")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"rloo.vllm_server_base_url {server.url}:")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in line
