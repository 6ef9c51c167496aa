"""The end-of-run summary (flows/report.py) for the CLI and the Prefect artifact: a language
model's loss leads, and a method that reports no loss (grpo: rewards) still gets its table
(the Prefect flow failed on a GRPO run with KeyError 'loss')."""

from __future__ import annotations

from flows.report import markdown

INFO = {"export_path": "data/export", "mlflow_run_id": "r1", "mlflow_uri": "sqlite:///m.db"}


def test_a_language_model_summary_leads_with_loss_and_says_whether_it_improved():
    ev = {"base": {"loss": 6.9884, "perplexity": 1083.94, "exact_match": 0.0},
          "finetuned": {"loss": 2.5285, "perplexity": 12.53, "exact_match": 0.0}}
    text = markdown({**INFO, "eval": ev})
    assert text.splitlines()[:4] == [
        "| model | eval loss | perplexity | exact_match |", "|---|---|---|---|",
        "| base | 6.9884 | 1083.94 | 0.0000 |", "| fine-tuned | 2.5285 | 12.53 | 0.0000 |"]
    assert "fine-tuning improved eval loss by +4.4599" in text


def test_a_method_without_a_loss_gets_its_own_columns():
    ev = {"base": {"reward": 0.05, "pass_at_1": 0.0},
          "finetuned": {"reward": 0.67, "pass_at_1": 0.0}, "generation_rows": 48}
    lines = markdown({**INFO, "eval": ev}).splitlines()
    assert lines[:4] == ["| model | pass_at_1 | reward |", "|---|---|---|",
                         "| base | 0.0000 | 0.0500 |", "| fine-tuned | 0.0000 | 0.6700 |"]
    assert not any("eval loss" in line for line in lines)


def test_the_summary_names_the_export_as_the_readme_shows_it(tmp_path):
    """`exported model: data/export`, relative to the project (not the clone's absolute
    path), as README.md shows it."""
    from finetune.config import load_config
    from finetune.workspace import Workspace
    from flows.report import summary
    from helpers import ROOT

    ws = Workspace(config=load_config(ROOT / "params/default.yaml"), root=tmp_path,
                   params_path=tmp_path / "params/default.yaml")
    info = summary(ws)
    assert info["export_path"] == "data/export"
    shown = "exported model: data/export (AutoModelForCausalLM.from_pretrained)"
    assert shown in markdown({**info, "eval": {}})
    assert shown in (ROOT / "README.md").read_text()
