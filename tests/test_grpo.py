"""Online RL with reward functions (training.type grpo, data.dataset_type prompt): the run's
guarantees. The shipped example (params/grpo-gsm8k.yaml) on the shipped stories260K, shrunk,
learns a reward it can learn in a few steps; logs TRL's statistics and a sample table; trains
the same on 2 processes as on 1; resumes bitwise from what a crash leaves, also with
num_iterations 2; keeps the reference the adapter-disabled base; and goes through the evaluate
stage and the registry gate on its rewards. (Loss, gradients and statistics against TRL's are
tests/test_grpo_trl.py; generation tests/test_grpo_generation.py; the rewards
tests/test_grpo_rewards.py; the prompt rows tests/test_prompt_type.py.)"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

#: the example, shrunk to seconds: 8 prompts x 4 completions of at most 16 tokens per step.
#: The format reward asks for a "!" (grpo.format_regex): stories260K writes one in about 1 of 5
#: completions of 16 tokens, so a group of 4 often has a reward to push up, and within a few
#: steps at this learning rate the model writes one nearly always (tests below)
TINY_GRPO = {"data.max_train_samples": 48, "data.max_eval_samples": 16,
             "data.max_seq_length": 256, "training.max_steps": 10,
             "training.per_device_train_batch_size": 8, "grpo.num_generations": 4,
             "grpo.max_completion_length": 16, "grpo.format_regex": "!",
             "optimizer.learning_rate": 0.005, "scheduler.warmup_steps": 0,
             "logging.logging_steps": 1, "checkpoint.save_steps": 3,
             "checkpoint.save_total_limit": None, "eval.eval_steps": 5,
             "eval.max_generation_samples": 8}
#: TRL's logged names (GRPOTrainer._metrics) for the example's two reward functions, beta 0
TRL_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "rewards/format/mean",
             "rewards/format/std", "rewards/correctness/mean", "rewards/correctness/std",
             "completions/mean_length", "completions/clipped_ratio", "entropy",
             "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "time/generation", "time/scoring")
#: the logged values that measure the machine, not the run
TIMING = ("tokens_per_second", "memory_rss_mb", "time/generation", "time/scoring")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """A project whose params are the shipped params/grpo-gsm8k.yaml in its resolved form (on
    the shipped stories260K instead of the default run's export), shrunk, with download,
    format and tokenize done."""
    from helpers import ON_STORIES, prepared_example

    return prepared_example(tmp_path_factory.mktemp("grpo") / "p", "params/grpo-gsm8k.yaml",
                            TINY_GRPO, *ON_STORIES)


@pytest.fixture(scope="module")
def grpo_run(prompts, tmp_path_factory) -> Path:
    """The shrunk example trained by the train stage (its MLflow run, for the registry)."""
    from helpers import train_copy

    return train_copy(prompts, tmp_path_factory.mktemp("grpo-run") / "p")[0]


def _rows(project: Path, file: str = "train.csv") -> list[dict]:
    with open(project / "data/plots" / file) as fh:
        return list(csv.DictReader(fh))


def _column(project: Path, name: str) -> list[float]:
    return [float(r[name]) for r in _rows(project)]


def _samples(project: Path) -> list[dict]:
    path = project / "data/plots/train_samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


# -- learning, and what is logged -----------------------------------------------------------

def test_the_reward_rises(grpo_run):
    """Mean format reward of the last two logged steps vs the first two (32 completions per
    step). Measured on this config with training.seed 1, 2, 3, 4, 5 and 42: 0.13 to 0.36 over
    the first two steps, 1.0 over the last two (the model writes a "!" in every completion
    from step 4 to 7 on); a run that does not learn stays near its start (the spread of a
    32-completion mean at p = 0.2 is 0.07)."""
    reward = _column(grpo_run, "reward")
    assert len(reward) == 10
    first, last = sum(reward[:2]) / 2, sum(reward[-2:]) / 2
    assert last > first + 0.4, reward
    assert _column(grpo_run, "rewards/format/mean") == reward  # correctness: 0, a 260K model
    assert set(_column(grpo_run, "rewards/correctness/mean")) == {0.0}


def test_the_rows_carry_trls_statistics_and_the_sample_table_each_logged_step(grpo_run):
    rows = _rows(grpo_run)
    # the timings are logged (MLflow) but kept out of the git-tracked train.csv: a rerun of
    # the same run must write the same bytes
    assert set(TRL_NAMES) - set(TIMING) <= set(rows[0]), sorted(rows[0])
    assert not set(TIMING) & set(rows[0]), sorted(rows[0])
    from mlflow.tracking import MlflowClient

    run_id = json.loads((grpo_run / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{grpo_run / 'mlflow.db'}")
    for name in ("time/generation", "time/scoring"):  # MLflow has them, one per logged step
        history = client.get_metric_history(run_id, name)
        assert len(history) == len(rows) and all(m.value >= 0 for m in history), name
    assert all(m.value > 0 for m in client.get_metric_history(run_id, "time/generation"))
    assert "kl" not in rows[0]  # beta 0: no reference, no kl (TRL logs none either)
    for row in rows:
        assert 0 < float(row["completions/mean_length"]) <= 16
        assert 0 <= float(row["completions/clipped_ratio"]) <= 1
        assert float(row["entropy"]) > 0
        assert 0 <= float(row["clip_ratio/region_mean"]) <= 1
    samples = _samples(grpo_run)
    assert {tuple(sorted(s)) for s in samples} == {
        ("completion", "correctness", "format", "prompt", "step")}
    by_step: dict[int, list[dict]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(1, 11))  # logged every step: each step's rollout
    for step, row in zip(sorted(by_step), rows):
        table = by_step[step]
        assert len(table) == 8 * 4 and len({s["prompt"] for s in table}) == 8
        assert all(s["format"] == float("!" in s["completion"]) for s in table)
        logged = float(row["rewards/format/mean"])
        assert sum(s["format"] for s in table) / len(table) == pytest.approx(logged, abs=1e-6)


# -- processes, resume ------------------------------------------------------------------------

def _assert_same_run(a: Path, b: Path) -> None:
    """The same completions (the sample tables' text), the same logged statistics (but the
    machine's), weights equal up to summation order."""
    from helpers import adapter, assert_weights_close

    assert _samples(b) == _samples(a)
    rows_a, rows_b = _untimed(_rows(a)), _untimed(_rows(b))
    assert [r.keys() for r in rows_b] == [r.keys() for r in rows_a]
    for x, y in zip(rows_a, rows_b):
        for name in x:
            if x[name] == "":  # not logged at that step (a step reusing a rollout)
                assert y[name] == "", (x["step"], name, y[name])
                continue
            assert float(y[name]) == pytest.approx(float(x[name]), rel=1e-5, abs=1e-5), (
                x["step"], name, x[name], y[name])
    assert_weights_close(adapter(b), adapter(a))


@pytest.mark.distributed
def test_two_processes_and_accumulation_equal_one_batch(prompts, tmp_path):
    """One process x 8 prompts equals DDP on 2 torchrun processes (gloo) x 4 prompts, and
    equals 2 accumulated micro-batches x 4 prompts: each prompt's completions are seeded by
    its position in the step's global batch, not by rank or micro-batch, so all three sample
    the same completions (the sample table, gathered from the ranks, is the same text) and
    log the same statistics over the step's completions; the weights agree to the summation
    order. The model here also ends a completion at '.' (an extra EOS in its generation
    config), so completions have different lengths and the length statistics are not
    trivially equal. SGD, as in tests/test_preference.py: Adam turns summation-order noise on
    near-zero gradient elements into lr-sized steps (weights 2e-3 apart after 10 steps at
    lr 1e-2, measured), and sampling then diverges after a few steps."""
    from transformers import AutoTokenizer

    from helpers import train_copy, train_here

    project = tmp_path / "p"
    shutil.copytree(prompts, project, symlinks=True)
    model = project / "data/models/stories260K"
    period = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(".")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "eos_token_id": [config["eos_token_id"], period]}))
    params = {"optimizer.name": "SGD", "optimizer.learning_rate": 0.5, "training.max_steps": 4,
              "eval.eval_steps": 4, "checkpoint.save_strategy": "no"}
    one, _ = train_here(project, tmp_path / "one", params)
    lengths = _column(one, "completions/mean_length")
    assert min(lengths) < 16 and len(set(lengths)) > 1, lengths  # the extra EOS ends some
    accumulated, _ = train_here(project, tmp_path / "acc", {
        **params, "training.per_device_train_batch_size": 4,
        "training.gradient_accumulation_steps": 2})
    _assert_same_run(one, accumulated)
    two, _ = train_copy(project, tmp_path / "two", {
        **params, "distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
        "training.per_device_train_batch_size": 4})
    _assert_same_run(one, two)


def test_gspo_with_the_masks_accumulates_as_one_batch_and_each_loss_logs_its_names(
        prompts, tmp_path):
    """The rest of the family in a run: GSPO (a sequence-level ratio, whose clip ratios are
    means over completions), two-sided clipping and the off-policy mask, over 2 iterations:
    2 accumulated micro-batches x 4 prompts equal one batch of 8; cispo logs
    cispo_clip_ratio and sapo no clip ratio, as TRL does (the formulas: test_grpo_trl.py)."""
    from helpers import train_here

    params = {"optimizer.name": "SGD", "optimizer.learning_rate": 0.5, "training.max_steps": 2,
              "eval.eval_steps": 2, "checkpoint.save_strategy": "no",
              "grpo.loss_type": "grpo", "grpo.importance_sampling_level": "sequence",
              "grpo.delta": 1.5, "grpo.off_policy_mask_threshold": 0.0,
              "grpo.num_iterations": 2}
    one, _ = train_here(prompts, tmp_path / "one", params)
    accumulated, _ = train_here(prompts, tmp_path / "acc", {
        **params, "training.per_device_train_batch_size": 4,
        "training.gradient_accumulation_steps": 2})
    _assert_same_run(one, accumulated)
    assert "clip_ratio/region_mean" in _rows(one)[0]
    for loss_type, has, lacks in (("cispo", "cispo_clip_ratio", "clip_ratio/region_mean"),
                                  ("sapo", "entropy", "clip_ratio/region_mean")):
        run, _ = train_here(prompts, tmp_path / loss_type, {
            **params, "grpo.loss_type": loss_type, "grpo.importance_sampling_level": "token",
            "grpo.delta": None, "grpo.epsilon_high": 5.0 if loss_type == "cispo" else None,
            "training.max_steps": 1, "eval.eval_steps": 1})
        row = _rows(run)[0]
        assert has in row and lacks not in row, (loss_type, sorted(row))


#: the shrunk example as RLOO (training.type rloo reads the rloo section): TRL's RLOO names
RLOO = {"training.type": "rloo", "rloo.num_generations": 4, "rloo.max_completion_length": 16,
        "rloo.format_regex": "!", "rloo.reward_funcs": ["format", "correctness"],
        "rloo.beta": 0.05, "rloo.num_iterations": 2, "rloo.normalize_advantages": True,
        "optimizer.name": "SGD", "optimizer.learning_rate": 0.5, "training.max_steps": 3,
        "eval.eval_steps": 3, "checkpoint.save_strategy": "no"}


def test_rloo_accumulates_as_one_batch_and_logs_trls_rloo_statistics(prompts, tmp_path):
    """training.type rloo, a GRPO run with RLOO's hooks (leave-one-out advantages with the
    KL as a reward penalty, the summed sequence ratio; formulas: test_rloo_trl.py): 2
    accumulated micro-batches x 4 prompts equal one batch of 8 (the gathered KL inputs and the
    completion-count divisor included), and a row logs TRL's RLOO names (kl from the rollout,
    clip ratios over completions) and the weights moved."""
    from helpers import adapter, train_here

    one, _ = train_here(prompts, tmp_path / "one", RLOO)
    accumulated, _ = train_here(prompts, tmp_path / "acc", {
        **RLOO, "training.per_device_train_batch_size": 4,
        "training.gradient_accumulation_steps": 2})
    _assert_same_run(one, accumulated)
    row = _rows(one)[-1]
    for name in ("reward", "frac_reward_zero_std", "rewards/format/mean", "kl", "entropy",
                 "clip_ratio/region_mean", "completions/mean_length"):
        assert name in row, (name, sorted(row))
    # step 1 samples with the reference itself (kl 0), step 2 trains on that rollout again
    # (no rollout statistics logged, as TRL logs them at generation steps only), step 3
    # samples with the policy after two updates
    kl = [r["kl"] for r in _rows(one)]
    assert float(kl[0]) == 0.0 and kl[1] == "" and float(kl[2]) != 0.0, kl
    assert _rows(one)[1]["reward"] == "" and float(_rows(one)[1]["entropy"]) > 0
    lora_b = [w for name, w in adapter(one).items() if "lora_B" in name]
    assert lora_b and any(w.abs().sum() > 0 for w in lora_b)  # B starts at zero: it trained


def test_dynamic_sampling_replaces_groups_without_spread_and_resumes_bitwise(prompts,
                                                                             grpo_run, tmp_path):
    """grpo.dynamic_sampling: the shrunk example's groups often have no spread (stories260K
    writes the format reward's '!' in about 1 of 5 completions, so 4 completions miss it
    together ~40% of the time). With it on, fewer groups of a step are left without spread
    (frac_reward_zero_std, over the trained groups) than in the same step without it, the
    share replaced is logged, the sample table holds the trained (replacing) groups, 2
    accumulated micro-batches x 4 prompts draw and train as one batch of 8 (a replacement is
    drawn by its group's position in the step), and a run cut back to its step-2 checkpoint
    resumes bitwise."""
    from helpers import resume_cut_back, train_here, train_in_place

    params = {"optimizer.name": "SGD", "optimizer.learning_rate": 0.5, "training.max_steps": 3,
              "eval.eval_steps": 3, "checkpoint.save_steps": 2}
    dynamic = {**params, "grpo.dynamic_sampling": True, "grpo.max_resample_times": 3}
    one, _ = train_here(prompts, tmp_path / "one", dynamic)
    rows, before = _rows(one), _rows(grpo_run)  # its step 1 samples what this one does
    refilled = [float(r["dynamic_sampling/refilled_ratio"]) for r in rows]
    assert refilled[0] > 0, refilled  # the first step's samples are the plain run's
    assert float(rows[0]["frac_reward_zero_std"]) < float(before[0]["frac_reward_zero_std"])
    assert len(_samples(one)) == 3 * 8 * 4  # 3 steps x 8 prompts x 4 completions
    first = [s for s in _samples(one) if s["step"] == 1]
    reward = sum(s["format"] for s in first) / len(first)
    assert reward == pytest.approx(float(rows[0]["reward"]), abs=1e-6)
    accumulated, _ = train_here(prompts, tmp_path / "acc", {
        **dynamic, "training.per_device_train_batch_size": 4,
        "training.gradient_accumulation_steps": 2})
    _assert_same_run(one, accumulated)
    resume_cut_back(one, tmp_path, 2, train_in_place)
    assert _samples(tmp_path / "cut") == _samples(one)


def test_a_prompts_completions_do_not_depend_on_the_other_prompts_of_the_call():
    """What makes the run's sampling independent of the world size: with one seed per prompt,
    each prompt's completions come from its own generator, whatever else is generated (and
    padded) with it, and in chunks of whole prompts; and the run's seeds differ per step and
    per position in the step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.rollout.generator import left_pad
    from engine.rollout.local import LocalGenerator
    from engine.rollout.sampling import SamplingParams
    from engine.recipe.grpo.run import prompt_seeds
    from helpers import ROOT

    path = ROOT / "data/models/stories260K"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(text)["input_ids"] for text in
               ("Once upon a time", "Tom had a big red ball and a small dog", "The cat")]
    params = SamplingParams(max_completion_length=12)
    generator = LocalGenerator(model, params, [tok.eos_token_id], 0)
    seeds = [11, 22, 33]
    together = generator.generate(*left_pad(prompts, 0), 4, seeds)
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        alone = generator.generate(*left_pad([prompt], 0), 4, [seed])
        rows, width = slice(4 * i, 4 * i + 4), alone.ids.shape[1]
        assert torch.equal(alone.ids, together.ids[rows, :width])
        assert torch.equal(alone.mask, together.mask[rows, :width])
        assert not together.mask[rows, width:].any()
    chunked = LocalGenerator(model, params, [tok.eos_token_id], 0, batch_size=8)
    assert torch.equal(chunked.generate(*left_pad(prompts, 0), 4, seeds).ids, together.ids)
    other = generator.generate(*left_pad(prompts, 0), 4, [12, 22, 33])
    assert not torch.equal(other.ids[:4], together.ids[:4])
    assert torch.equal(other.ids[4:], together.ids[4:])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generator.generate(*left_pad(prompts, 0), 4, [1, 2])
    every = [s for step in range(50) for s in prompt_seeds(42, step, 0, 64)]
    assert len(set(every)) == len(every)
    assert prompt_seeds(42, 3, 4, 4) == prompt_seeds(42, 3, 0, 8)[4:]


def test_a_grpo_run_resumes_bitwise_from_what_a_crash_leaves(grpo_run, tmp_path):
    """The run cut back to what a SIGKILL right after its step-3 checkpoint leaves, resumed:
    the same weights bitwise, the same logged rows and the same sample table (the crashed
    run's later samples dropped, not doubled). The completions of a resumed step are seeded
    as the uninterrupted run's were."""
    from helpers import resume_cut_back, train_in_place

    # what a crash leaves beside the checkpoint: the samples of steps past it
    resume_cut_back(grpo_run, tmp_path, 3, train_in_place)
    cut = tmp_path / "cut"
    assert _untimed(_rows(cut)) == _untimed(_rows(grpo_run))
    assert _samples(cut) == _samples(grpo_run)


def _cut_back(full: Path, dest: Path, at: int) -> Path:
    """A copy of `full` as a crash right after its step-`at` checkpoint leaves it, set to
    resume (helpers.resume_cut_back's cut, without its assertions)."""
    from helpers import write_params

    shutil.copytree(full, dest, symlinks=True)
    for checkpoint in (dest / "data/checkpoints").glob("step-*"):
        if int(checkpoint.name.removeprefix("step-")) > at:
            shutil.rmtree(checkpoint)
    shutil.rmtree(dest / "data/trained")
    write_params(dest, {"checkpoint.resume_from_checkpoint": True})
    return dest


def test_num_iterations_2_resumes_bitwise_at_a_generation_batch_boundary(prompts, tmp_path):
    """With num_iterations 2 every generation batch is trained on twice (steps 1-2, 3-4,
    5-6). Resumed from the step-4 checkpoint (a boundary) the run ends bitwise as the
    uninterrupted one. Resumed from step 3 (inside a batch, whose completions are not in the
    checkpoint) it says it generates that batch again, and finishes."""
    from helpers import resume_cut_back, train_here, train_in_place

    full, _ = train_here(prompts, tmp_path / "full", {
        "grpo.num_iterations": 2, "training.max_steps": 6, "checkpoint.save_steps": 1,
        "checkpoint.save_total_limit": None, "eval.eval_steps": 6})
    # the second pass of a batch measures its ratio against the first pass's weights
    region = _column(full, "clip_ratio/region_mean")
    assert all(region[i] == 0 for i in (0, 2, 4)) and any(region[i] > 0 for i in (1, 3, 5))
    samples = _samples(full)
    for first, second in ((1, 2), (3, 4), (5, 6)):  # one rollout per batch, trained twice
        assert ([(s["prompt"], s["completion"]) for s in samples if s["step"] == first]
                == [(s["prompt"], s["completion"]) for s in samples if s["step"] == second])
    out = resume_cut_back(full, tmp_path, 4, train_in_place)
    assert "resumed inside a generation batch" not in out
    assert _samples(tmp_path / "cut") == samples

    inside = _cut_back(full, tmp_path / "inside", 3)
    out = train_in_place(inside).stdout
    assert ("[train] step 4: resumed inside a generation batch (grpo.num_iterations); "
            "generating it again with the current weights") in out
    assert [r["step"] for r in _rows(inside)] == [str(s) for s in range(1, 7)]


def test_repeat_steps_repeats_each_steps_micro_batches_and_resumes_anywhere():
    """num_iterations' stream (engine.recipe.grpo.batches.repeat_steps): each optimizer
    step's `accum` micro-batches come `repeats` times, epoch after epoch; keys count
    positions in the repeated stream, and opening it at any position (what a checkpoint
    stores) continues it exactly."""
    from engine.recipe.grpo.batches import repeat_steps

    length, accum, repeats = 4, 2, 3  # 2 optimizer steps per epoch of the loader

    def opened(epoch, start):
        while True:
            for index in range(start, length):
                yield {"key": torch.tensor([epoch, index]), "row": (epoch, index)}
            epoch, start = epoch + 1, 0

    def take(stream, n):
        return [(b["key"].tolist(), b["row"]) for b in (next(stream) for _ in range(n))]

    per_epoch = length * repeats
    full = take(repeat_steps(opened, 0, 0, accum, repeats), 3 * per_epoch)
    rows = [row for _, row in full]
    assert rows[:per_epoch] == [(0, 0), (0, 1)] * 3 + [(0, 2), (0, 3)] * 3
    assert rows[per_epoch:2 * per_epoch] == [(1, 0), (1, 1)] * 3 + [(1, 2), (1, 3)] * 3
    assert [key for key, _ in full] == [[e, i] for e in range(3) for i in range(per_epoch)]
    for epoch in range(2):
        for start in range(per_epoch + 1):  # every position, the epoch's end included
            at = epoch * per_epoch + start
            resumed = take(repeat_steps(opened, epoch, start, accum, repeats), per_epoch)
            assert resumed == full[at:at + per_epoch], (epoch, start)
    assert take(repeat_steps(opened, 0, 0, 1, 1), 5) == [([e, i], (e, i)) for e, i in
                                                          [(0, 0), (0, 1), (0, 2), (0, 3),
                                                           (1, 0)]]


# -- the reference ----------------------------------------------------------------------------

def test_beta_under_peft_takes_the_base_with_the_adapter_disabled(prompts, tmp_path,
                                                                   monkeypatch):
    """beta > 0 with LoRA loads no second model (loading one fails here); the reference is
    the base: kl is exactly 0 while the adapter is the fresh one (B = 0), then the adapter
    moves away from it and kl is logged > 0."""
    from engine.recipe import reference
    from helpers import train_here

    def no_second_model(*args, **kwargs):
        raise AssertionError("a reference model was loaded beside the LoRA policy")

    monkeypatch.setattr(reference, "load_base_model", no_second_model)
    run, out = train_here(prompts, tmp_path / "kl", {"grpo.beta": 0.1, "training.max_steps": 3,
                                                     "checkpoint.save_strategy": "no"})
    assert "frozen copy" not in out.stdout
    kl = _column(run, "kl")
    assert kl[0] == 0.0 and kl[1] > 0 and kl[2] > 0, kl


def test_beta_with_full_fine_tuning_says_it_holds_a_frozen_copy(prompts, tmp_path):
    from helpers import train_here

    run, out = train_here(prompts, tmp_path / "full", {
        "grpo.beta": 0.1, "peft.use_peft": False, "training.max_steps": 2,
        "checkpoint.save_strategy": "no"})
    line = ("[train] grpo.beta > 0 with peft.use_peft false: the reference is a frozen copy of "
            "the base model, a second model's memory on every rank")
    assert out.stdout.count(line) == 1, out.stdout
    kl = _column(run, "kl")
    assert kl[0] == 0.0 and kl[1] > 0, kl


# -- the config -------------------------------------------------------------------------------

def _config(overrides: dict, params: str = "params/grpo-gsm8k.yaml"):
    import yaml

    from finetune.config.loader import set_keys, validate_raw
    from helpers import ROOT

    raw = yaml.safe_load((ROOT / params).read_text())
    return validate_raw(set_keys(raw, overrides), source="p.yaml")


def test_grpo_refuses_rows_that_are_not_prompts_and_its_rows_are_in_the_table():
    """The grpo section's compatibility rows (packing, padding-free, pipeline, collate_fn, ...)
    are in the table, so tests/test_compat.py's per-row test refuses each one's example in one
    line; rows of another type are refused here, in one line."""
    from finetune.config import compat, grpo
    from finetune.errors import PipelineError

    assert all(any(r is row for r in compat.RULES) for row in grpo.ROWS)
    for method in ("grpo", "rloo"):  # every rollout method's shared rows (rollout_method)
        assert {"training.packing", "distributed.strategy", "data.collate_fn"} <= {
            compat.full_key(r) for r in compat.RULES
            if r.example.get("training.type") == method}, method
    with pytest.raises(PipelineError) as refused:
        _config({"data.dataset_type": "completion"})
    assert str(refused.value) == (
        "p.yaml: training.type: grpo trains on prompt-only rows (completions are generated "
        "during training); set data.dataset_type: prompt")


def test_the_gate_takes_a_reward_the_run_reports_and_refuses_one_it_does_not():
    """The evaluate stage of a grpo run reports its rewards and pass rates only
    (engine.recipe.grpo.heldout): the gate may name one of them, and nothing else, not even
    the loss and text-match metrics the prompt type's rows would have under another method
    (a gate on a metric that never comes leaves every model a candidate)."""
    from finetune.errors import PipelineError

    for metric in ("eval.sampled_reward_format", "eval.reward_correctness", "eval.pass_at_4"):
        assert _config({"registry.gate_metric": metric}).registry.gate_metric == metric
    reported = ("eval.pass_at_1, eval.pass_at_4, eval.reward, eval.reward_correctness, "
                "eval.reward_format, eval.sampled_reward, eval.sampled_reward_correctness, "
                "eval.sampled_reward_format")
    for metric in ("eval.reward_nonexistent", "eval.loss", "eval.exact_match"):
        with pytest.raises(PipelineError) as refused:
            _config({"registry.gate_metric": metric})
        assert str(refused.value) == (f"p.yaml: registry.gate_metric {metric} is not reported "
                                      f"for training.type grpo (it reports {reported})")


# -- the last two stages ----------------------------------------------------------------------

def test_the_example_runs_through_evaluate_and_export_and_samples_the_format_more(grpo_run,
                                                                                 tmp_path):
    """Base and fine-tuned on the held-out prompts: each reward greedy and sampled (k = 4),
    the pass rates of the correctness reward; the registry gates on the sampled format
    reward, which training raised."""
    from helpers import stages_here

    project = tmp_path / "p"
    shutil.copytree(grpo_run, project, symlinks=True)
    stages_here(project, "evaluate", "export")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    names = {"reward", "reward_format", "reward_correctness", "sampled_reward",
             "sampled_reward_format", "sampled_reward_correctness", "pass_at_1", "pass_at_4"}
    base, tuned = metrics["base"], metrics["finetuned"]
    assert names <= set(base) and names <= set(tuned), metrics
    for side in (base, tuned):
        assert all(0 <= side[name] <= 1 for name in names)
        assert side["pass_at_1"] == side["reward_correctness"]  # greedy: pass or not, per row
    assert tuned["sampled_reward_format"] > base["sampled_reward_format"] + 0.3, metrics
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version["gate_metric"] == "eval.sampled_reward_format" and version["promoted"]
    assert version["value"] == tuned["sampled_reward_format"]
