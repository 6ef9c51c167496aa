"""eval.harness: lm-evaluation-harness tasks in the evaluate stage. What the stage records is
what lm-eval itself computes for the same model and task; the gate can name a harness metric;
bad input and a missing lm-eval are one line each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT

#: a log-likelihood task made here (lm-eval's wikitext layout on GSM8K's answers): its numbers
#: differ between models, where a 260K model's GSM8K exact match is 0 for both
PERPLEXITY_TASK = """task: gsm8k_answers_ppl
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
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
SETTINGS = {"num_fewshot": 0, "limit": 20, "batch_size": 20, "max_gen_toks": 48}


@pytest.fixture(scope="module")
def evaluated(tokenized, tmp_path_factory) -> Path:
    """The default run shrunk and trained, then evaluated with two harness tasks: the shipped
    GSM8K one and the perplexity task above (a folder of task files)."""
    from helpers import BASE, stages_here, train_here, write_params

    project, _ = train_here(tokenized, tmp_path_factory.mktemp("harness") / "p", BASE)
    (project / "my_tasks").mkdir()
    (project / "my_tasks/ppl.yaml").write_text(PERPLEXITY_TASK)
    write_params(project, {"eval.harness": {
        "tasks": ["data/harness/gsm8k_local.yaml", "my_tasks"], **SETTINGS},
        "eval.generation_metrics": [], "eval.num_logged_samples": 0})
    stages_here(project, "evaluate")
    return project


def _direct(model, tok, project: Path, manager) -> dict:
    """lm-eval called directly on `model`, outside our code."""
    import os

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    here = os.getcwd()
    os.chdir(project)
    try:
        out = simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=20, device="cpu"),
            tasks=["gsm8k_local", "gsm8k_answers_ppl"], num_fewshot=0, limit=20,
            task_manager=manager, gen_kwargs={"max_gen_toks": 48}, log_samples=False,
            bootstrap_iters=1000)
    finally:
        os.chdir(here)
    return {f"harness.{task}.{key.replace(',', '.')}": value
            for task, metrics in out["results"].items() for key, value in metrics.items()
            if "," in key and isinstance(value, (int, float))}


def test_the_stage_records_what_lm_eval_itself_computes(evaluated):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_eval.tasks import TaskManager

    recorded = json.loads((evaluated / "data/metrics/eval.json").read_text())
    tok = AutoTokenizer.from_pretrained(evaluated / "data/trained")
    manager = TaskManager(include_path=[str(evaluated / "data/harness"),
                                        str(evaluated / "my_tasks")])
    base = AutoModelForCausalLM.from_pretrained(evaluated / "data/models/stories260K")
    expected = {"base": _direct(base, tok, evaluated, manager)}
    # the adapter's layers in the model, active (no merge: the weights the stage ran)
    tuned = PeftModel.from_pretrained(base, str(evaluated / "data/trained")).get_base_model()
    expected["finetuned"] = _direct(tuned, tok, evaluated, manager)
    for name in ("base", "finetuned"):
        ours = {k: v for k, v in recorded[name].items() if k.startswith("harness.")}
        assert ours.keys() == expected[name].keys()
        assert len(ours) == 7  # exact match by two filters and their stderr, 3 perplexities
        for key, value in expected[name].items():
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
    ppl = "harness.gsm8k_answers_ppl.bits_per_byte.none"
    assert recorded["finetuned"][ppl] < recorded["base"][ppl]  # fine-tuning helped, measurably


def test_the_gate_promotes_or_holds_on_a_harness_metric(evaluated, tmp_path):
    """The export's gate reads the harness metric from eval.json, and the registry (MLflow on
    SQLite) promotes the first version and holds an equal one."""
    from helpers import write_params
    from mlflow import MlflowClient

    from finetune.config.registry import RegistryConfig
    from finetune.workspace import Workspace
    from tasks.export import _gate_value
    from tasks.registry import promote

    gate = "eval.harness.gsm8k_answers_ppl.bits_per_byte.none"
    write_params(evaluated, {"registry.gate_metric": gate, "registry.greater_is_better": False})
    ws = Workspace.load(evaluated / "params/default.yaml")
    value = _gate_value(ws, json.loads((evaluated / "data/metrics/eval.json").read_text()))
    assert value is not None and value > 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("m")
    cfg = RegistryConfig(gate_metric=gate, greater_is_better=False)
    for version in ("1", "2"):
        client.create_model_version("m", "file:///x", run_id=None)
    first = promote(client, "m", "1", value, cfg)
    second = promote(client, "m", "2", value, cfg)
    assert first.promoted and "first model" in first.reason
    assert not second.promoted and "does not beat" in second.reason
    assert str(client.get_model_version_by_alias("m", "champion").version) == "1"


def test_the_stage_checks_every_eval_set_for_contamination(evaluated, tmp_path):
    """The evaluate stage's contamination check covers the held-out split and each harness
    task's documents (the 20 it evaluates): clean here, recorded in eval.json and the rows
    file (and the MLflow run: tests/test_reward.py). With 5 held-out rows planted in the formatted training rows, the check
    reports exactly those rows in the held-out split and the same questions among the GSM8K
    task's documents."""
    import shutil

    import pandas as pd

    from finetune.workspace import Workspace
    from tasks import contamination
    from tasks.harness import resolve_tasks

    sets = {"heldout", "harness.gsm8k_local", "harness.gsm8k_answers_ppl"}
    recorded = json.loads((evaluated / "data/metrics/eval.json").read_text())["contamination"]
    assert set(recorded) == sets
    assert all(m == {"overlap_fraction": 0.0, "overlapping_rows": 0} for m in recorded.values())
    rows = json.loads((evaluated / "data/eval/contamination.json").read_text())
    assert rows["ngram"] == 13 and set(rows["sets"]) == sets

    project = tmp_path / "p"
    shutil.copytree(evaluated, project, symlinks=True)
    train = pd.read_parquet(project / "data/formatted/train.parquet")
    test = pd.read_parquet(project / "data/formatted/test.parquet")
    planted = [1, 4, 9, 12, 15]  # of the 16 held-out rows
    dirty = pd.concat([train.iloc[:10], test.iloc[planted], train.iloc[10:]], ignore_index=True)
    dirty.to_parquet(project / "data/formatted/train.parquet", index=False)
    ws = Workspace.load(project / "params/default.yaml")
    report = contamination.measure(ws, resolve_tasks(ws.config.eval.harness.tasks, project))
    assert report["sets"]["heldout"]["rows"] == planted
    assert report["sets"]["heldout"]["train_rows"] == [10, 11, 12, 13, 14]
    questions = [json.loads(line)["question"] for line in
                 (project / "data/source/gsm8k/test.jsonl").read_text().splitlines()[:20]]
    asked = [q for q in questions if any(q in p for p in test.iloc[planted]["prompt"])]
    assert len(asked) == 5
    assert report["sets"]["harness.gsm8k_local"]["rows"] == [questions.index(q) for q in asked]


@pytest.mark.parametrize("tasks, expected", [
    (["no_such_task_anywhere"], "eval.harness.tasks: unknown task 'no_such_task_anywhere'"),
    (["data/harness/missing.yaml"], "eval.harness.tasks: task file data/harness/missing.yaml "
                                    "not found"),
])
def test_a_bad_task_is_one_line_naming_the_key(project, tasks, expected):
    from helpers import write_params

    from finetune.errors import PipelineError
    from finetune.workspace import Workspace
    from tasks.checks import check_harness

    write_params(project, {"eval.harness.tasks": tasks})
    with pytest.raises(PipelineError) as exc:
        check_harness(Workspace.load(project / "params/default.yaml"))
    assert str(exc.value).startswith(expected) and "\n" not in str(exc.value)


def test_without_lm_eval_the_section_says_how_to_install_it(monkeypatch):
    from finetune.errors import PipelineError
    from tasks.harness import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` sees uninstalled
    with pytest.raises(PipelineError) as exc:
        require_lm_eval()
    message = str(exc.value)
    assert "\n" not in message and message.startswith("eval.harness.tasks needs")
    assert "pip install 'finetune-pipeline[harness]'" in message


def test_the_shipped_task_is_lm_evals_gsm8k_on_local_files():
    """Everything but the data source is lm-eval's own gsm8k task."""
    import lm_eval
    import yaml

    ours = yaml.safe_load((ROOT / "data/harness/gsm8k_local.yaml").read_text())
    theirs = Path(lm_eval.__file__).parent / "tasks/gsm8k/gsm8k.yaml"
    theirs = yaml.safe_load(theirs.read_text())
    differ = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
    assert differ == {"task", "dataset_path", "dataset_name", "dataset_kwargs", "tag"}
    assert ours["dataset_path"] == "json"
    assert all((ROOT / f).exists() for f in ours["dataset_kwargs"]["data_files"].values())


def test_apply_chat_template_uses_the_trained_tokenizers_template(tmp_path):
    """The chat template comes from the trained tokenizer (the train stage saves a chat
    dataset's data.chat_template with it, tests/test_chat.py); a tokenizer without one is one
    line."""
    from transformers import AutoTokenizer

    from finetune.errors import PipelineError
    from tasks.harness import chat_tokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")
    tok.save_pretrained(tmp_path / "plain")
    with pytest.raises(PipelineError, match=r"^eval.harness.apply_chat_template: the trained "
                                            r"tokenizer .* has no chat template"):
        chat_tokenizer(tmp_path / "plain")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "chat")
    assert chat_tokenizer(tmp_path / "chat").chat_template == tok.chat_template


def test_the_harness_example_evaluates_the_default_runs_training():
    """params/harness-gsm8k.yaml is the default run plus the harness: every params key the
    stages up to train list in dvc.yaml is the default's as written (DVC compares the file's
    values, not the resolved ones: a whole `training` section with one more default-valued key
    reruns train) and as resolved, so after the default run, the README's `cp` of it over
    params/default.yaml finds train up to date and trains nothing (the example had drifted to
    native CPU numerics once: another model; and shown as `finetune config -p ... > x.yaml`,
    its resolved sections made DVC retrain the same model for 4 minutes)."""
    import yaml
    from finetune.config.loader import load_config

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    keys = []
    for name in ("validate", "download", "format", "tokenize", "train"):
        for entry in stages[name].get("params", []):
            for listed in (entry.values() if isinstance(entry, dict) else [[entry]]):
                keys += listed

    def value(config: dict, key: str):
        for part in key.split("."):
            config = (config or {}).get(part)
        return config

    assert len(keys) > 20, keys
    for read in (lambda f: yaml.safe_load(f.read_text()),
                 lambda f: load_config(f).model_dump()):
        default, harness = (read(ROOT / "params" / f) for f in ("default.yaml",
                                                                "harness-gsm8k.yaml"))
        differ = [k for k in keys if value(default, k) != value(harness, k)]
        assert differ == [], differ
    assert value(harness, "eval.harness.tasks") == ["data/harness/gsm8k_local.yaml"]
