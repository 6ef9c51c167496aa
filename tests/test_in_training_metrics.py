"""Generation metrics during training (eval.during_training_metrics): the number logged at a
step is the evaluate stage's on those weights and rows, early stopping and the best checkpoint
follow them (with a threshold in standard errors), a resumed run stops where an uninterrupted
one does, validate refuses what a run would not report, and 2 processes log what 1 does."""

from __future__ import annotations

import csv
import json
import shutil

import pandas as pd
import pytest
import torch

from helpers import (adapter, copy_project, refused_here, resume_cut_back, stages_here,
                     train_copy_here, train_here, train_in_place, train_metrics, write_params)

#: rouge scores above 0 on the shipped stories260K; exact_match stays 0 there
GENERATING = {"eval.during_training_metrics": True,
              "eval.generation_metrics": ["exact_match", "rouge"],
              "eval.generation_max_new_tokens": 16}
ROUGE = ("rouge1", "rouge2", "rougeL")


def _eval_rows(project) -> list[dict]:
    with open(project / "data/plots/eval.csv") as fh:
        return list(csv.DictReader(fh))


def test_the_subset_is_seeded_and_the_same_at_every_draw():
    from finetune.datatypes.generations import training_subset

    rows = pd.DataFrame({"prompt": [f"p{i}" for i in range(20)], "reference": list(range(20))})
    a, b = training_subset(rows, 5, seed=7), training_subset(rows, 5, seed=7)
    assert a.equals(b) and len(a) == 5
    assert list(a["reference"]) == sorted(a["reference"])  # the rows' own order
    assert not a.equals(training_subset(rows, 5, seed=8))
    assert training_subset(rows, 20, seed=7).equals(rows)  # all of them: the rows as they are
    assert training_subset(rows, 50, seed=7).equals(rows)


def test_the_logged_number_is_the_evaluate_stage_s_on_those_weights(tokenized, tmp_path):
    """during_training_samples = max_generation_samples: the same rows, in the same order, so
    the step-3 checkpoint's logged eval_<metric> and its stderr equal the evaluate stage's
    numbers for the trained model (the step-3 weights)."""
    project, out = train_here(tokenized, tmp_path / "p", {
        **GENERATING, "eval.max_generation_samples": 8, "eval.during_training_samples": 8,
        "training.max_steps": 3, "eval.eval_steps": 3, "checkpoint.save_steps": 3,
        "eval.num_logged_samples": 0, "eval.contamination_ngram": None})
    last = _eval_rows(project)[-1]
    assert last["step"] == "3" and (project / "data/checkpoints/step-0000003").is_dir()
    assert "eval_seconds=" in out.stdout
    assert train_metrics(project)["eval_seconds"] > 0
    assert "eval_seconds" not in last  # a measurement of the machine: off the curves
    stages_here(project, "evaluate")
    stage = json.loads((project / "data/metrics/eval.json").read_text())["finetuned"]
    assert float(last["eval_rouge1"]) > 0
    for name in ("exact_match", *ROUGE):
        assert float(last[f"eval_{name}"]) == stage[name], name
        assert float(last[f"eval_{name}_stderr"]) == stage[f"{name}_stderr"], name


#: a log-likelihood task (test_harness.py's: lm-eval's wikitext layout on GSM8K's answers),
#: whose perplexity moves with every step, where a 260K model's GSM8K exact match stays 0
PPL_TASK = """task: gsm8k_answers_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/source/gsm8k/test.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{answer}}"
metric_list:
  - metric: word_perplexity
"""
PPL = "harness.gsm8k_answers_ppl.word_perplexity.none"
EXACT = "harness.gsm8k_local.exact_match.flexible-extract"
#: 2 evaluations (steps 1 and 2), each running both harness tasks on 3 documents (lm-eval's
#: limit = eval.during_training_samples), ranked by the perplexity (lower wins: derived)
HARNESS = {"eval.harness": {"tasks": ["data/harness/gsm8k_local.yaml",
                                      "my_tasks/gsm8k_answers_ppl.yaml"],
                            "num_fewshot": 0, "limit": 3, "batch_size": 3,
                            "max_gen_toks": 8, "models": ["finetuned"]},
           "eval.during_training_metrics": [PPL, EXACT], "eval.during_training_samples": 3,
           "eval.generation_metrics": [], "eval.num_logged_samples": 0,
           "eval.contamination_ngram": None, "training.max_steps": 2, "eval.eval_steps": 1,
           "checkpoint.save_steps": 1, "checkpoint.metric_for_best_model": f"eval_{PPL}"}


def test_a_harness_task_during_training_logs_the_evaluate_stage_s_number(tokenized, tmp_path):
    """eval.during_training_metrics names harness metrics as eval.json spells them: lm-eval
    runs them on the current weights at every evaluation (engine.evaluation.harness, the
    evaluate stage's code) with limit = eval.during_training_samples; the step-2 numbers
    (the trained model's) are the evaluate stage's with eval.harness.limit the same, stderr
    included, and the best step is the lowest perplexity's."""
    src = tmp_path / "src"
    shutil.copytree(tokenized, src, symlinks=True)
    (src / "my_tasks").mkdir()
    (src / "my_tasks/gsm8k_answers_ppl.yaml").write_text(PPL_TASK)
    project, _ = train_here(src, tmp_path / "p", HARNESS)
    rows = _eval_rows(project)
    assert [r["step"] for r in rows] == ["1", "2"]
    assert [k for k in rows[0] if k != "step"] == [
        "eval_loss", f"eval_{PPL}", f"eval_{EXACT}", f"eval_{EXACT}_stderr"]
    ppl = [float(r[f"eval_{PPL}"]) for r in rows]
    assert ppl[0] != ppl[1] and all(p > 1 for p in ppl)
    m = train_metrics(project)
    assert (m["best_step"], m[f"best_eval_{PPL}"]) == (1 + ppl.index(min(ppl)), min(ppl))
    stages_here(project, "evaluate")
    stage = json.loads((project / "data/metrics/eval.json").read_text())["finetuned"]
    assert float(rows[-1][f"eval_{PPL}"]) == stage[PPL]
    assert float(rows[-1][f"eval_{EXACT}"]) == stage[EXACT]
    assert float(rows[-1][f"eval_{EXACT}_stderr"]) == stage[
        "harness.gsm8k_local.exact_match_stderr.flexible-extract"]


#: the tool-calling example (params/tools-gsm8k.yaml) on its 265 training conversations, fully
#: fine-tuned: stories260K writes parseable calls from about step 30 (LoRA at 40 steps, or 40
#: full steps, still writes a wrong byte where the JSON's `{` goes, or stops mid-call); scored
#: on the first 8 generation rows (6 calling turns), evaluated at steps 50 and 60
TOOLS = "params/tools-gsm8k.yaml"
CALLING = {"data.max_eval_samples": 8, "training.max_steps": 60,
           "training.per_device_train_batch_size": 4, "training.per_device_eval_batch_size": 8,
           "logging.logging_steps": 10, "peft.use_peft": False,
           "optimizer.learning_rate": 0.005, "scheduler.warmup_steps": 1,
           "eval.eval_steps": 10, "eval.eval_delay": 50, "eval.eval_batches": 1,
           "checkpoint.save_steps": 50, "eval.max_generation_samples": 8,
           "eval.generation_max_new_tokens": 96, "eval.during_training_metrics": ["tool_calls"],
           "eval.during_training_samples": 8, "eval.num_logged_samples": 0,
           "eval.contamination_ngram": None, "distributed.threads_per_process": 1,
           "checkpoint.metric_for_best_model": "eval_tool_name_match",
           "checkpoint.load_best_model_at_end": True}


@pytest.mark.slow
def test_tool_calls_score_above_zero_during_training_as_evaluate_scores_them(tmp_path):
    """The issue's bar: a real model scoring above 0 on a cut of the tools example's rows
    logs eval_tool_name_match > 0 at every evaluation; ranked by it, the best checkpoint is
    the trained model (load_best_model_at_end), its numbers are the evaluate stage's, and
    the export stage exports its weights. The list names the tool-call metrics only, so
    exact_match is not logged during training (the evaluate stage still reports it)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    project = copy_project(tmp_path / "p")
    write_params(project, CALLING, name=TOOLS)
    stages_here(project, "download", "format", "tokenize", "train", params=TOOLS)
    rows = _eval_rows(project)
    assert [r["step"] for r in rows] == ["50", "60"]
    # the calls' scores are means over the calling turns: their stderrs resample those
    assert [k for k in rows[0] if k != "step"] == [
        "eval_loss", "eval_tool_name_match", "eval_tool_arguments_match",
        "eval_tool_name_match_stderr", "eval_tool_arguments_match_stderr"]
    scores = [float(r["eval_tool_name_match"]) for r in rows]
    assert all(score > 0 for score in scores), rows
    best = scores.index(max(scores))  # the first of equals: a tie is no improvement
    m = train_metrics(project)
    assert (m["best_step"], m["loaded_best_step"], m["best_eval_tool_name_match"]) == (
        int(rows[best]["step"]), int(rows[best]["step"]), max(scores))
    stages_here(project, "evaluate", "export", params=TOOLS)
    stage = json.loads((project / "data/metrics/eval.json").read_text())["finetuned"]
    assert "exact_match" in stage
    for name in ("tool_name_match", "tool_arguments_match"):
        assert float(rows[best][f"eval_{name}"]) == stage[name], name
        assert float(rows[best][f"eval_{name}_stderr"]) == stage[f"{name}_stderr"], name
    dcp_to_torch_save(project / f"data/checkpoints/step-{m['best_step']:07d}",
                      tmp_path / "best.pt")
    saved = torch.load(tmp_path / "best.pt", weights_only=False)["model"]
    exported = load_file(str(project / "data/export/model.safetensors"))
    assert exported.keys() == saved.keys()
    for key, value in exported.items():
        assert torch.equal(saved[key], value), key


#: eval and save every step; rouge1 must gain 50 standard errors of the difference to count
#: as an improvement, which it never does: patience 2 stops at step 3
STALLS = {**GENERATING, "eval.during_training_samples": 6, "training.max_steps": 10,
          "eval.eval_steps": 1, "checkpoint.save_steps": 1, "checkpoint.save_total_limit": 2,
          "checkpoint.metric_for_best_model": "eval_rouge1",
          "eval.early_stopping_patience": 2, "eval.early_stopping_threshold_stderr": 50.0,
          "checkpoint.load_best_model_at_end": True}


@pytest.fixture(scope="module")
def stalled(tokenized, tmp_path_factory):
    return train_here(tokenized, tmp_path_factory.mktemp("stall") / "p", STALLS)


def test_early_stopping_and_the_best_checkpoint_follow_the_generation_metric(stalled,
                                                                             tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    project, out = stalled
    rows = _eval_rows(project)
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert "[train] early stopping at step 3: eval_rouge1" in out.stdout
    scores = [float(r["eval_rouge1"]) for r in rows]
    # it rose at step 2, by less than 50 standard errors: without the stderr threshold that
    # gain would have reset the patience counter and the run would not stop at step 3
    assert scores[1] > scores[0] and float(rows[1]["eval_rouge1_stderr"]) > 0
    best = 1 + scores.index(max(scores))  # higher is better: derived from the metric
    m = train_metrics(project)
    assert (m["best_step"], m["best_eval_rouge1"], m["loaded_best_step"]) == (
        best, max(scores), best)
    dcp_to_torch_save(project / f"data/checkpoints/step-{best:07d}", tmp_path / "best.pt")
    saved = torch.load(tmp_path / "best.pt", weights_only=False)["model"]
    trained = adapter(project)
    assert trained
    for key, value in trained.items():
        assert torch.equal(saved[key.replace(".weight", ".default.weight")], value), key


def test_a_resumed_run_stops_where_the_uninterrupted_one_did(stalled, tmp_path):
    """Cut back to the step-2 checkpoint (best and patience counter mid-way) and resumed: the
    same stop, the same best, bitwise the same weights and curves."""
    full, _ = stalled

    def monitor(project, step):
        return torch.load(project / f"data/checkpoints/step-{step:07d}/trainer.pt",
                          weights_only=False)["monitor"]

    # the step-2 checkpoint: rouge1 rose (the new best) by less than the threshold, so the
    # patience counter is 1; a resume that lost it would stop at step 4, not 3
    assert (monitor(full, 2)["best_step"], monitor(full, 2)["bad_evals"]) == (2, 1)
    out = resume_cut_back(full, tmp_path, 2, train_in_place)
    assert "[train] early stopping at step 3" in out
    cut = tmp_path / "cut"
    assert monitor(cut, 3) == monitor(full, 3) and monitor(full, 3)["bad_evals"] == 2
    a, b = train_metrics(full), train_metrics(cut)
    assert (b["global_step"], b["best_step"], b["best_eval_rouge1"]) == (
        a["global_step"], a["best_step"], a["best_eval_rouge1"])
    assert _eval_rows(cut) == _eval_rows(full)


@pytest.mark.parametrize("params, named", [
    ({"checkpoint.metric_for_best_model": "eval_exact_match"},
     "checkpoint.metric_for_best_model eval_exact_match is a generation metric, not measured "
     "during training; set eval.during_training_metrics: true"),
    ({**GENERATING, "checkpoint.metric_for_best_model": "eval_tool_name_match"},
     "checkpoint.metric_for_best_model eval_tool_name_match needs 'tool_calls' in "
     "eval.generation_metrics"),
    ({**GENERATING, "checkpoint.metric_for_best_model": "eval_rouge1",
      "eval.early_stopping_patience": 2, "eval.early_stopping_threshold_stderr": 1.0,
      "eval.bootstrap_samples": 0},
     "eval.early_stopping_threshold_stderr: eval_rouge1 has no standard error with "
     "eval.bootstrap_samples 0"),
    ({"checkpoint.metric_for_best_model": "eval_loss", "eval.early_stopping_patience": 2,
      "eval.early_stopping_threshold_stderr": 1.0},
     "eval.early_stopping_threshold_stderr: checkpoint.metric_for_best_model eval_loss has "
     "no standard error during training"),
    ({**GENERATING, "eval.during_training_metrics": ["rouge1", "gsm8k"]},
     "eval.during_training_metrics: gsm8k is not a metric the evaluate stage reports for this "
     "run (generation metrics: exact_match, rouge, rouge1, rouge2, rougeL; harness metrics: "
     "harness.<task>.<metric>.<filter> of eval.harness.tasks, now empty)"),
    ({**GENERATING, "eval.during_training_metrics": [EXACT]},
     f"eval.during_training_metrics: {EXACT} is an lm-evaluation-harness metric of task "
     "gsm8k_local, and eval.harness.tasks is empty"),
    ({**HARNESS, "eval.during_training_metrics": ["harness.gsm8k.exact_match.strict-match"]},
     "eval.during_training_metrics: harness.gsm8k.exact_match.strict-match is of task gsm8k, "
     "which eval.harness.tasks does not list"),
    ({**HARNESS, "distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2},
     f"eval.during_training_metrics: {PPL} runs lm-eval on one process's whole model, and "
     "distributed.strategy fsdp2 splits it across ranks"),
    ({**GENERATING, "eval.during_training_metrics": ["tool_name_match"]},
     "eval.during_training_metrics: tool_name_match needs 'tool_calls' in "
     "eval.generation_metrics"),
    ({"eval.during_training_metrics": True, "data.dataset_type": "classification",
      "data.prompt_template": None, "data.completion_template": None,
      "eval.generation_metrics": []}, "eval.during_training_metrics: data.dataset_type "
     "classification trains a classifier"),
])
def test_validate_and_the_train_stage_refuse_what_a_run_would_not_report(
        project, params, named, capsys, monkeypatch):
    """`finetune validate` (in this process: its exit code and one error line) and the train
    stage both refuse, naming the key and what to set."""
    from flows.cli import main

    write_params(project, params)
    monkeypatch.chdir(project)
    code = main(["validate"])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert named in errors[0], errors[0]
    line = refused_here(project, "train")
    assert named in line, line


@pytest.mark.parametrize("setting, named", [
    ("+eval.during_training_metrics=[pass_at_1]",
     "eval.during_training_metrics: pass_at_1 is the evaluate stage's (training.type grpo); "
     "during training it logs its own numbers (a rollout method: eval_reward"),
    ("+checkpoint.metric_for_best_model=eval_loss",
     "checkpoint.metric_for_best_model eval_loss is not reported during training for "
     "data.dataset_type prompt (it reports eval_reward)"),
    ("+checkpoint.metric_for_best_model=eval_reward", None),
])
def test_a_rollout_method_ranks_by_its_greedy_reward_and_refuses_pass_at_k(
        project, setting, named, capsys, monkeypatch):
    """GRPO's in-training evaluation reports eval_reward (and no loss): metric_for_best_model
    may name it; pass@k and the sampled rewards are the evaluate stage's only, refused in one
    line naming the key."""
    from flows.cli import main

    monkeypatch.chdir(project)
    code = main(["validate", "-p", "params/grpo-gsm8k.yaml", "-s", setting,
                 "-s", "model.name_or_path=data/models/stories260K"])
    err = capsys.readouterr().err
    if named is None:
        assert code == 0, err
        return
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert named in errors[0], errors[0]


#: SGD, so the weights agree to the summation order (Adam would turn that noise into lr-sized
#: steps); patience 1 with a threshold of 1.0: stopped at step 2
LOCKSTEP = {**GENERATING, "eval.during_training_samples": 7, "optimizer.name": "SGD",
            "optimizer.learning_rate": 0.05, "training.max_steps": 2, "eval.eval_steps": 1,
            "checkpoint.save_strategy": "no", "checkpoint.metric_for_best_model": "eval_rouge1",
            "eval.early_stopping_patience": 1, "eval.early_stopping_threshold": 1.0}


@pytest.fixture(scope="module")
def one_process(tokenized, tmp_path_factory):
    """The tokenized project with stories260K also ending a text at '.' (so ranks finish at
    different tokens), and its run on one process: what each strategy's 2 processes match."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("lockstep")
    src = tmp / "src"
    shutil.copytree(tokenized, src, symlinks=True)
    model = src / "data/models/stories260K"
    period = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(".")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "eos_token_id": [config["eos_token_id"], period]}))
    one, _ = train_here(src, tmp / "one", LOCKSTEP)
    return src, one


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_processes_log_what_one_does(one_process, tmp_path, strategy):
    """FSDP2 and DDP on 2 torchrun processes (gloo): each rank generates its rows in
    lockstep (ranks finish at different tokens, and generate's synced loop is what keeps
    FSDP2's gathers paired), the texts are gathered and scored on every rank: the same
    eval_<metric> values, the same early stop."""
    src, one = one_process
    two, _ = train_copy_here(src, tmp_path / "two", {
        **LOCKSTEP, "distributed.strategy": strategy, "distributed.nproc_per_node": 2})
    rows = _eval_rows(one)
    assert [r["step"] for r in rows] == ["1", "2"]  # stopped early at step 2
    assert float(rows[0]["eval_rouge1"]) > 0
    assert [{k: v for k, v in r.items() if k != "eval_loss"} for r in _eval_rows(two)] == [
        {k: v for k, v in r.items() if k != "eval_loss"} for r in rows]
    assert train_metrics(two)["best_eval_rouge1"] == train_metrics(one)["best_eval_rouge1"]


@pytest.mark.distributed
def test_under_ddp_rank_0_runs_the_harness_task_and_every_rank_logs_it(tokenized, tmp_path):
    """DDP on 2 torchrun processes (gloo), half the per-device batch so the steps see the rows
    one process does (SGD, no warmup): rank 0 runs lm-eval on its replica and broadcasts the
    numbers, which are one process's: the loss equal, the perplexity (an exp of summed
    log-likelihoods) to the summation order of the weights' updates."""
    src = tmp_path / "src"
    shutil.copytree(tokenized, src, symlinks=True)
    (src / "my_tasks").mkdir()
    (src / "my_tasks/gsm8k_answers_ppl.yaml").write_text(PPL_TASK)
    same = {**HARNESS, "optimizer.name": "SGD", "optimizer.learning_rate": 0.05,
            "scheduler.warmup_steps": 0, "checkpoint.save_strategy": "no"}
    one, _ = train_here(src, tmp_path / "one", {**same,
                                                "training.per_device_train_batch_size": 8})
    two, _ = train_copy_here(src, tmp_path / "two", {
        **same, "training.per_device_train_batch_size": 4, "distributed.strategy": "ddp",
        "distributed.nproc_per_node": 2})
    a, b = _eval_rows(one), _eval_rows(two)
    assert [r["step"] for r in b] == ["1", "2"] and a[0].keys() == b[0].keys()
    for x, y in zip(a, b):
        assert x["eval_loss"] == y["eval_loss"]
        assert float(y[f"eval_{PPL}"]) == pytest.approx(float(x[f"eval_{PPL}"]), rel=1e-5)
        assert x[f"eval_{EXACT}"] == y[f"eval_{EXACT}"]
    assert float(a[0][f"eval_{PPL}"]) != float(a[1][f"eval_{PPL}"])  # the weights moved
