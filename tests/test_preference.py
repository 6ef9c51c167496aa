"""Preference tuning (training.type dpo, data.dataset_type preference): the losses and reward
statistics against TRL's own (the oracle), the pairs as the type makes them, and the run's
guarantees (accumulation, DDP, resume) as the SFT run has them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from helpers import ROOT

MODEL = ROOT / "data/models/stories260K"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant: {% endif %}")
STRING_ROWS = [
    {"prompt": "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
     "chosen": " 3 + 4 = 7\n#### 7", "rejected": " 3 + 4 = 9\n#### 9"},
    {"prompt": "Question: A box holds 12 eggs. Half break. How many are left?\nAnswer:",
     "chosen": " 12 / 2 = 6\n#### 6", "rejected": " 12 / 2 = 5 eggs are left\n#### 5"},
    {"prompt": "Question: Sam reads 5 pages a day for 4 days. Pages?\nAnswer:",
     "chosen": " 5 x 4 = 20 pages\n#### 20", "rejected": " 5 x 4 = 24\n#### 24"},
]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": r["prompt"]}],
              "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
              "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]}
             for r in STRING_ROWS]


def _tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _encode(rows: list[dict], chat: bool) -> tuple[list[dict], pd.DataFrame]:
    """The rows as the preference type formats and tokenizes them."""
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    data = DataConfig(dataset_type="preference", data_files={"train": "x.jsonl"},
                      chat_template=CHAT_TEMPLATE if chat else None)
    tok = _tokenizer()
    ctx = DataContext(ROOT, lambda: tok)
    datatype = data.datatype
    formatted = datatype.format(pd.DataFrame(rows), "train", ctx)
    assert formatted.dropped == []
    fn, kwargs = datatype.encoder(ctx)
    enc = fn(formatted.rows.to_dict("list"), tok=tok, **kwargs)
    keys = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
    return [dict(zip(keys, values)) for values in zip(*(enc[k] for k in keys))], formatted.rows


def _models():
    """(policy, reference): the real tiny Llama, and the policy a perturbed copy of it, so the
    log-ratios are not zero."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    policy = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return policy, ref


def _ours(policy, ref, pairs: list[dict], dpo) -> tuple[torch.Tensor, dict]:
    from engine.datapath.data import collate
    from engine.objective.logprobs import next_token_logps, sequence_logps
    from engine.recipe.dpo.batches import collate_pairs
    from engine.recipe.dpo.loss import chosen_nll, logged, preference_loss

    tok = _tokenizer()
    batch = collate_pairs(pairs, lambda sides: collate(sides, tok.pad_token_id))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = policy(**inputs).logits
    logps, counts = sequence_logps(logits, batch["labels"])
    ref_logps = nll = None
    if dpo.uses_reference:
        with torch.no_grad():
            ref_logps = sequence_logps(ref(**inputs).logits, batch["labels"])[0]
    if dpo.loss_type == "orpo":
        nll = chosen_nll(next_token_logps(logits, batch["input_ids"]),
                         batch["attention_mask"])
    out = preference_loss(dpo, logps, counts, ref_logps, nll)
    stats = {name: float(v) / len(pairs) for name, v in zip(logged(dpo), out.sums())}
    return out.losses.mean(), stats


def _trl_batch(trainer, pairs: list[dict]) -> dict:
    """The same token ids in TRL's layout (prompt / completion split at the label mask),
    collated by TRL's own collator."""
    examples = []
    for p in pairs:
        start = next(i for i, x in enumerate(p["labels"]) if x != -100)
        r_start = next(i for i, x in enumerate(p["rejected_labels"]) if x != -100)
        assert p["input_ids"][:start] == p["rejected_input_ids"][:r_start]
        examples.append({"prompt_ids": p["input_ids"][:start],
                         "chosen_ids": p["input_ids"][start:],
                         "rejected_ids": p["rejected_input_ids"][r_start:]})
    return trainer.data_collator(examples)


def _trl_dpo(tmp_path, policy, ref, pairs, **config) -> tuple[float, dict]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(pairs), **config)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=_tokenizer(),
                         train_dataset=Dataset.from_list(STRING_ROWS))
    policy.train()  # as the trainer runs it (no dropout in this model: same numbers)
    loss = trainer._compute_loss(policy, _trl_batch(trainer, pairs), return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _trl_cpo(policy, ref, pairs, loss_type, beta, gamma, label_smoothing) -> tuple[float, dict]:
    """TRL's CPOTrainer loss function (TRL's SimPO is CPO's simpo loss with cpo_alpha 0) on
    log-probabilities from its own get_batch_logps (length-averaged for simpo). With `ref`,
    the log-ratios are handed in as its log-probabilities: CPO's sigmoid on them is DPO's
    sigmoid with label smoothing (conservative DPO), which TRL 1.16's DPOTrainer dropped."""
    from trl.experimental.cpo import CPOTrainer

    from engine.datapath.data import collate
    from engine.recipe.dpo.batches import collate_pairs

    tok = _tokenizer()
    batch = collate_pairs(pairs, lambda sides: collate(sides, tok.pad_token_id))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    average = loss_type == "simpo"
    logps = CPOTrainer.get_batch_logps(policy(**inputs).logits, batch["labels"], average)
    chosen, rejected = logps.chunk(2)
    scored = logps
    if ref is not None:
        with torch.no_grad():
            scored = logps - CPOTrainer.get_batch_logps(ref(**inputs).logits, batch["labels"])
    trainer = SimpleNamespace(alpha=0.0, loss_type=loss_type, simpo_gamma=gamma, beta=beta,
                              label_smoothing=label_smoothing,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, c_rewards, r_rewards = CPOTrainer.cpo_loss(trainer, *scored.chunk(2))
    return float(losses.mean()), {
        "rewards/chosen": float(c_rewards.mean()), "rewards/rejected": float(r_rewards.mean()),
        "rewards/accuracies": float((c_rewards > r_rewards).float().mean()),
        "rewards/margins": float((c_rewards - r_rewards).mean()),
        "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean())}


LOSSES = [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.2), ("simpo", 0.0), ("simpo", 0.1),
          ("sigmoid", 0.1)]


@pytest.mark.parametrize("chat", [False, True], ids=["strings", "conversational"])
@pytest.mark.parametrize("loss_type, smoothing", LOSSES,
                         ids=[f"{t}-ls{s}" for t, s in LOSSES])
def test_losses_and_reward_metrics_equal_trls(tmp_path, chat, loss_type, smoothing):
    from finetune.config.preference import DPOConfig

    pairs, _ = _encode(CHAT_ROWS if chat else STRING_ROWS, chat)
    policy, ref = _models()
    dpo = DPOConfig(beta=0.3, loss_type=loss_type, label_smoothing=smoothing, simpo_gamma=0.4)
    ours, stats = _ours(policy, ref, pairs, dpo)
    if loss_type == "simpo" or smoothing and loss_type == "sigmoid":
        theirs, trl_stats = _trl_cpo(policy, None if loss_type == "simpo" else ref, pairs,
                                     loss_type, 0.3, 0.4, smoothing)
    else:
        theirs, trl_stats = _trl_dpo(tmp_path, policy, ref, pairs, beta=0.3,
                                     loss_type=[loss_type], label_smoothing=smoothing)
    assert abs(float(ours) - theirs) < 1e-5, (float(ours), theirs)
    for name, value in stats.items():
        assert abs(value - trl_stats[name]) < 1e-5 * max(1.0, abs(value)), name


def _trl_orpo(tmp_path, policy, pairs: list[dict], beta: float) -> tuple[float, dict]:
    """TRL's ORPOTrainer on each pair alone (its NLL is a token mean over the whole batch;
    ours is each pair's own, so a step's loss is a mean over pairs), averaged over the pairs:
    the loss and every statistic TRL logs under the names ours uses."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      beta=beta, per_device_train_batch_size=1)
    trainer = ORPOTrainer(model=policy, args=args, processing_class=_tokenizer(),
                          train_dataset=Dataset.from_list(STRING_ROWS))
    losses, stats = [], []
    for p in pairs:
        sides = {f"{side}_{key}": value for side, ids, labels in (
            ("chosen", p["input_ids"], p["labels"]),
            ("rejected", p["rejected_input_ids"], p["rejected_labels"]))
            for key, value in (("input_ids", ids), ("attention_mask", [1] * len(ids)),
                               ("labels", labels))}
        loss, metrics = trainer.get_batch_loss_metrics(policy, trainer.data_collator([sides]))
        losses.append(float(loss))
        stats.append(metrics)
    return sum(losses) / len(pairs), {k: sum(m[k] for m in stats) / len(pairs)
                                      for k in stats[0]}


@pytest.mark.parametrize("chat", [False, True], ids=["strings", "conversational"])
def test_orpo_loss_and_statistics_equal_trls(tmp_path, chat):
    """orpo: the chosen side's NLL (prompt included, as TRL trains it) minus beta x log
    sigmoid of the log odds ratio; the logged statistics are TRL's, nll_loss and the odds
    ratio's included; no reference is used (the reference model is never called)."""
    from finetune.config.preference import DPOConfig

    pairs, _ = _encode(CHAT_ROWS if chat else STRING_ROWS, chat)
    policy, _ = _models()
    dpo = DPOConfig(beta=0.3, loss_type="orpo")
    assert not dpo.uses_reference
    ours, stats = _ours(policy, None, pairs, dpo)
    assert set(stats) >= {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/margins"}
    theirs, trl_stats = _trl_orpo(tmp_path, policy, pairs, 0.3)
    assert abs(float(ours) - theirs) < 1e-5, (float(ours), theirs)
    for name, value in stats.items():
        assert abs(value - trl_stats[name]) < 1e-5 * max(1.0, abs(value)), name


def test_conversational_sides_are_what_the_chat_template_renders():
    """Each side is what the full conversation adds after the prompt's rendering with the
    generation prompt (TRL's split), end-of-turn marker included; no EOS is added on top."""
    tok = _tokenizer()
    pairs, rows = _encode(CHAT_ROWS, chat=True)
    for row, pair, formatted in zip(CHAT_ROWS, pairs, rows.itertuples()):
        prompt = tok.apply_chat_template(row["prompt"], chat_template=CHAT_TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(row["prompt"] + row["chosen"],
                                       chat_template=CHAT_TEMPLATE, tokenize=False)
        assert prompt.lstrip(tok.bos_token or "") == formatted.prompt
        assert full[len(prompt):] == formatted.completion
        assert formatted.eos is False and formatted.completion.endswith(tok.eos_token + "\n")
        trained = [t for t, label in zip(pair["input_ids"], pair["labels"]) if label != -100]
        assert trained == tok(formatted.completion, add_special_tokens=False)["input_ids"]


def test_pairs_with_nothing_to_prefer_are_dropped_and_counted():
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    rows = pd.DataFrame([*STRING_ROWS[:2],
                         {"prompt": "Q", "chosen": " same", "rejected": " same"},
                         {"prompt": "Q", "chosen": "  ", "rejected": " x"},
                         {"prompt": "Q", "chosen": " y", "rejected": None}])
    data = DataConfig(dataset_type="preference", data_files={"train": "x.jsonl"})
    out = data.datatype.format(rows, "train", DataContext(ROOT, _tokenizer), first_row=10)
    assert out.dropped == [12, 13, 14] and len(out.rows) == 2
    assert out.reason == "an empty side, or chosen equal to rejected"
    assert list(out.rows["eos"]) == [True, True]


# -- the run: the example file through the stages, and the SFT run's guarantees --------------

TINY_DPO = {"data.max_seq_length": 512, "training.max_steps": 4, "data.max_train_samples": 32,
            "data.max_eval_samples": 16, "eval.max_generation_samples": 4,
            "logging.logging_steps": 1, "checkpoint.save_steps": 2, "eval.eval_steps": 2,
            "scheduler.warmup_steps": 0,
            # SGD: the two sides of a pair share most tokens, so many gradient elements are
            # differences near 0, and Adam would turn their summation-order noise into full
            # lr-sized steps; SGD keeps the equality tests' weights comparable
            "optimizer.name": "SGD", "optimizer.learning_rate": 0.05}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """A project whose params are the shipped params/dpo-gsm8k.yaml in its resolved form (on
    the shipped stories260K instead of the default run's export), shrunk, with download,
    format and tokenize done."""
    from helpers import ON_STORIES, prepared_example

    return prepared_example(tmp_path_factory.mktemp("dpo") / "p", "params/dpo-gsm8k.yaml",
                            TINY_DPO, *ON_STORIES)


@pytest.fixture(scope="module")
def dpo_run(pairs, tmp_path_factory) -> Path:
    """The shrunk example trained by the train stage (its MLflow run, for the registry),
    reference forward every step."""
    from helpers import train_stage_copy

    return train_stage_copy(pairs, tmp_path_factory.mktemp("dpo-run") / "p")


def _rows(project: Path, file: str = "train.csv") -> list[dict]:
    import csv

    with open(project / "data/plots" / file) as fh:
        return list(csv.DictReader(fh))


def test_the_run_starts_at_log2_and_logs_trls_statistics(dpo_run):
    """A fresh LoRA adapter leaves the policy equal to the reference (the adapter disabled),
    so the first step's sigmoid loss is log 2 and every reward is 0; the logged rows carry
    TRL's statistics and the evaluations the held-out pairs' loss."""
    import math

    rows = _rows(dpo_run)
    assert len(rows) == 4 and abs(float(rows[0]["loss"]) - math.log(2)) < 1e-6
    assert float(rows[0]["rewards/margins"]) == 0.0 and float(rows[0]["rewards/chosen"]) == 0.0
    for row in rows[1:]:  # the policy has moved: the pairs' rewards are no longer 0
        assert float(row["rewards/chosen"]) != 0 and float(row["rewards/margins"]) != 0
        assert float(row["logps/chosen"]) < 0 and float(row["logps/rejected"]) < 0
    assert [r["step"] for r in _rows(dpo_run, "eval.csv")] == ["2", "4"]


def test_gradient_accumulation_2_x_batch_b_is_batch_2b(pairs, dpo_run, tmp_path):
    """The loss is the mean over the step's pairs, not over each micro-batch's."""
    from helpers import adapter, assert_weights_close, losses, train_here

    accumulated, _ = train_here(pairs, tmp_path / "acc", {
        "training.per_device_train_batch_size": 2, "training.gradient_accumulation_steps": 2})
    assert_weights_close(adapter(accumulated), adapter(dpo_run))
    assert losses(accumulated) == pytest.approx(losses(dpo_run), abs=1e-5)


def test_precomputed_reference_log_probs_train_the_same(pairs, dpo_run, tmp_path):
    from helpers import adapter, assert_weights_close, losses, train_here

    precomputed, out = train_here(pairs, tmp_path / "pre",
                                  {"dpo.precompute_ref_log_probs": True})
    import datasets

    rows = datasets.load_from_disk(str(pairs / "data/tokenized/train")).num_rows
    assert f"reference log-probabilities of {rows} pairs precomputed" in out.stdout
    assert_weights_close(adapter(precomputed), adapter(dpo_run))
    # the table's pairs were scored in other batches (other padding): ~1e-6 apart per pair
    assert losses(precomputed) == pytest.approx(losses(dpo_run), abs=1e-4)


def test_full_fine_tuning_takes_a_frozen_copy_as_its_reference(pairs, tmp_path):
    import math

    from helpers import losses, train_here

    full, _ = train_here(pairs, tmp_path / "full", {"peft.use_peft": False,
                                                    "training.max_steps": 2})
    first, second = losses(full)
    assert abs(first - math.log(2)) < 1e-6 and second != first


@pytest.fixture(scope="module")
def orpo_run(pairs, tmp_path_factory) -> Path:
    """The shrunk example trained with dpo.loss_type orpo, in this process (the train stage's
    job; the stage itself, under torchrun, is the DDP test's)."""
    from helpers import train_here

    return train_here(pairs, tmp_path_factory.mktemp("orpo-run") / "p",
                      {"dpo.loss_type": "orpo"})[0]


def test_an_orpo_run_logs_trls_statistics_and_learns(orpo_run):
    """Every logged loss is the NLL minus beta x the mean log sigmoid of the log odds ratio
    (TRL's names), and the held-out pairs' orpo loss falls."""
    rows = _rows(orpo_run)
    assert len(rows) == 4
    for row in rows:
        assert float(row["loss"]) == pytest.approx(
            float(row["nll_loss"]) - 0.1 * float(row["log_odds_ratio"]), abs=1e-5)
        assert float(row["log_odds_ratio"]) < 0 and float(row["logps/chosen"]) < 0
        assert float(row["rewards/chosen"]) == pytest.approx(0.1 * float(row["logps/chosen"]))
    evals = _rows(orpo_run, "eval.csv")
    assert [r["step"] for r in evals] == ["2", "4"]
    assert float(evals[1]["eval_loss"]) < float(evals[0]["eval_loss"])


@pytest.mark.parametrize("strategy, loss_type", [("ddp", "sigmoid"), ("fsdp2", "sigmoid"),
                                                 ("ddp", "orpo"), ("fsdp2", "orpo")])
@pytest.mark.distributed
def test_two_processes_equal_one(pairs, request, tmp_path, strategy, loss_type):
    """DDP, and FSDP2 with the reference forward through the sharded model (the adapter
    disabled), on 2 torchrun processes x 2 pairs equal one process x 4 pairs; orpo (each
    pair's own NLL, no reference) too."""
    from helpers import adapter, assert_weights_close, losses, train_copy_here

    one = request.getfixturevalue("orpo_run" if loss_type == "orpo" else "dpo_run")
    run, _ = train_copy_here(pairs, tmp_path / strategy, {
        "distributed.strategy": strategy, "distributed.nproc_per_node": 2,
        "training.per_device_train_batch_size": 2, "dpo.loss_type": loss_type})
    assert_weights_close(adapter(run), adapter(one))
    assert losses(run) == pytest.approx(losses(one), abs=1e-5)


@pytest.mark.parametrize("run", ["dpo_run", "orpo_run"])
def test_a_dpo_run_resumes_bitwise_from_what_a_crash_leaves(request, tmp_path, run):
    """The run cut back to what a SIGKILL right after its step-2 checkpoint leaves (the later
    checkpoint, the trained model and the curves gone), resumed: it ends bitwise as the
    uninterrupted run. (The SIGKILL itself and the stage's resume are the SFT run's,
    tests/test_training.py; what is DPO's own here is its state: the reference, the pair
    statistics, the order of the pairs.)"""
    from helpers import resume_cut_back, train_in_place

    resume_cut_back(request.getfixturevalue(run), tmp_path, 2, train_in_place)


def test_the_example_runs_through_evaluate_and_export_and_ranks_pairs_better(dpo_run, tmp_path):
    """The last two stages on the trained example: the evaluate stage reports how the base
    and the fine-tuned model rank the held-out pairs, the registry gates on it."""
    import shutil

    from helpers import stages_here

    project = tmp_path / "p"
    shutil.copytree(dpo_run, project, symlinks=True)
    stages_here(project, "evaluate", "export")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    base, tuned = metrics["base"], metrics["finetuned"]
    assert base["preference_accuracy"] == 0.5 and base["reward_margin"] == 0  # ties
    assert tuned["preference_accuracy"] > base["preference_accuracy"]
    assert tuned["reward_margin"] > 0 and tuned["logp_margin"] > base["logp_margin"]
    assert 0 <= base["likelihood_accuracy"] <= 1
    # bootstrap stderrs over the pairs: the base ties every pair, so its accuracy cannot move
    assert base["preference_accuracy_stderr"] == 0
    assert (tuned["preference_accuracy_stderr"] > 0) == (0 < tuned["preference_accuracy"] < 1)
    assert tuned["loss_stderr"] > 0 and tuned["logp_margin_stderr"] > 0
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version["gate_metric"] == "eval.preference_accuracy" and version["promoted"]
    assert version["value"] == tuned["preference_accuracy"]
