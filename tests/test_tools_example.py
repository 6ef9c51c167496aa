"""The shipped tool-calling example (params/tools-gsm8k.yaml: GSM8K's calculator annotations as
calls, data/source/gsm8k-tools/) through all six stages on a cut: the calls are scored, and the
tokenized rows train the calls and not the tool results."""

from __future__ import annotations

import json
import re

from helpers import copy_project, stages_here, write_params
from finetune.workspace import Workspace
from tasks.show_rows import show_rows

PARAMS = "params/tools-gsm8k.yaml"
#: the cut: the test split's first rows, few steps and short generations (a call is ~55 tokens)
CUT = {"data.max_train_samples": 48, "data.max_eval_samples": 8,
       "training.max_steps": 6, "training.per_device_train_batch_size": 4,
       "training.per_device_eval_batch_size": 8, "logging.logging_steps": 2,
       "checkpoint.save_steps": 3, "eval.eval_steps": 3, "eval.eval_batches": 1,
       "scheduler.warmup_steps": 1, "eval.max_generation_samples": 8,
       "eval.generation_max_new_tokens": 96, "distributed.threads_per_process": 1}


def test_the_tool_calling_example_runs_through_all_six_stages(tmp_path):
    project = copy_project(tmp_path / "p")
    write_params(project, CUT, name=PARAMS)
    stages_here(project, "download", "format", "tokenize", "train", "evaluate", "export",
                params=PARAMS)
    evaluation = json.loads((project / "data/metrics/eval.json").read_text())
    for model in ("base", "finetuned"):
        for metric in ("tool_name_match", "tool_arguments_match"):
            assert 0.0 <= evaluation[model][metric] <= 1.0, (model, metric, evaluation[model])
    assert (project / "data/export/config.json").exists()
    shown = show_rows(Workspace.load(project / PARAMS), rows=1)
    trained = re.findall(r"⟦(.*?)⟧", shown, flags=re.S)
    call = 'Call: {"name": "calculator", "arguments": {"expression": "48/2"}}</s>'
    assert any(call in part for part in trained), shown
    # the tool's result and the next turn's generation prompt are context, not trained
    assert "⟧Result: 24\nAssistant: ⟦24 clips in May." in shown, shown
    assert not any("Result:" in part for part in trained), shown
