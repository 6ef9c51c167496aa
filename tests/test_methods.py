"""A training method is one room plus one registry line (issue 51): a toy method written in
one file, with its own columns, batches, step preparation, loss, logged statistic and
held-out metric, trains through all six stages without an edit to any product file."""

from __future__ import annotations

import json

import pytest
from helpers import logged_column, plugin_run, product_changes, sft_first_step_loss

# The whole method, as a project would write it: nothing else in the project changes.
TOY_METHOD = '''
"""Per-example SFT: each example weighs the same in the loss (the mean of its tokens'
losses), not each token."""
import torch

from engine.datapath.data import MODEL_COLUMNS, model_inputs
from engine.recipe.run import TrainingRun
from finetune.config.methods import Method


def with_lengths(rows, collate_fn):
    """The run's own collation, plus each example's token count from the split's `length`
    column (a column SFT does not read)."""
    batch = collate_fn(rows)
    batch["lengths"] = torch.tensor([r["length"] for r in rows])
    return batch


class PerExampleRun(TrainingRun):
    method = Method("per-example", accepts=("tokens",))
    columns = (*MODEL_COLUMNS, "length")

    def prepare_model(self):
        super().prepare_model()
        inner = self.collate_fn
        self.collate_fn = lambda rows: with_lengths(rows, inner)
        self.examples_logged = torch.zeros((), dtype=torch.float64)

    def prepare_step(self, micro):
        for batch in micro:  # the step's targets exist only once this ran
            assert int(batch["lengths"].sum()) == int(batch["attention_mask"].sum())
            batch["toy_examples"] = batch["lengths"].numel()
        return micro

    def count_targets(self, host_batch):
        return host_batch["toy_examples"]

    def window_metrics(self):
        logged, self.examples_logged = self.examples_logged, torch.zeros_like(
            self.examples_logged)
        return {"toy/examples": logged}

    def micro_step(self, host_labels, batch, divisor):
        logits = self.model(**model_inputs(batch), use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
            reduction="none").view(labels.shape)
        trained = (labels != -100).sum(1).clamp_min(1)
        loss_sum = (per_token.sum(1) / trained).sum()
        (loss_sum / divisor).backward()
        self.examples_logged += len(labels)
        return loss_sum

    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        def rows_scored(held, results):
            for name in ("base", "finetuned"):
                results[name]["toy_rows"] = len(held.test)

        return super().heldout_metrics(held, after_loss=rows_scored)
'''


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    return plugin_run(tmp_path_factory.mktemp("toy"), "toy_method.py", TOY_METHOD,
                      {"training.type": "toy_method.py:PerExampleRun", "training.max_steps": 8})


def test_a_method_in_one_file_trains_through_all_six_stages(toy_run):
    losses = logged_column(toy_run, "loss")
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    # the method's own statistic, summed per window and divided by its own targets (examples)
    assert logged_column(toy_run, "toy/examples") == [1.0] * 8
    evaluation = json.loads((toy_run / "data/metrics/eval.json").read_text())
    test_rows = json.loads((toy_run / "data/metrics/tokenize.json").read_text())["test"]["rows"]
    for name in ("base", "finetuned"):  # the evaluate stage asked the method
        assert evaluation[name]["toy_rows"] == test_rows, evaluation
    assert evaluation["finetuned"]["loss"] < evaluation["base"]["loss"], evaluation
    assert (toy_run / "data/export/adapter_config.json").exists() or (
        toy_run / "data/export/config.json").exists()
    # nothing but the method's file (and the params naming it) was added to the project
    assert product_changes(toy_run) == sorted(
        [" M params/default.yaml", "?? toy_method.py"])


def test_the_per_example_objective_is_not_sfts(toy_run, tmp_path):
    """The loss the toy run logged is its own: SFT's token-weighted loss on the same first
    step differs (examples of different lengths weigh differently)."""
    assert sft_first_step_loss(toy_run, tmp_path) != pytest.approx(
        logged_column(toy_run, "loss")[0], abs=1e-6)


def _config(overrides: dict):
    import yaml

    from finetune.config.loader import set_keys, validate_raw
    from helpers import ROOT

    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    return validate_raw(set_keys(raw, overrides), source="p.yaml")


def test_a_trainer_type_may_set_the_model_it_trains():
    """A method's facts (finetune.config.methods) decide the model when they name one (a
    reward model's head), else the dataset type's does; the derived class follows."""
    from finetune.config import methods
    from finetune.datatypes import SEQUENCE_CLASSIFICATION
    from finetune.errors import PipelineError

    assert _config({}).model_task.auto_class == "AutoModelForCausalLM"
    methods.register_method(methods.Method("scorer", task=SEQUENCE_CLASSIFICATION))
    try:
        cfg = _config({"training.type": "scorer"})
        assert cfg.model_task is SEQUENCE_CLASSIFICATION
        assert cfg.model.auto_class_name == "AutoModelForSequenceClassification"
        assert cfg.peft.task_type == "SEQ_CLS"
        with pytest.raises(PipelineError, match="model.auto_class_name: AutoModelForCausalLM "
                           "does not fit training.type scorer"):
            _config({"training.type": "scorer",
                     "model.auto_class_name": "AutoModelForCausalLM"})
    finally:
        del methods._METHODS["scorer"]


def test_a_trainer_type_refuses_rows_it_does_not_train_on():
    from finetune.config import methods
    from finetune.errors import PipelineError

    methods.register_method(methods.Method("pairs-only", accepts=("pairs",)))
    try:
        with pytest.raises(PipelineError, match="training.type: pairs-only trains on pairs rows; "
                           "data.dataset_type completion gives tokens"):
            _config({"training.type": "pairs-only"})
    finally:
        del methods._METHODS["pairs-only"]
    with pytest.raises(ValueError, match="accepts unknown targets"):
        methods.Method("typo", accepts=("pair",))


def test_prompt_only_rows_keep_no_trained_token_through_the_row_contract():
    """A dataset type whose rows carry no targets (a prompt its method completes) passes the
    tokenized contract with no trainable token; every other kind needs one."""
    import pandas as pd

    from finetune.datatypes.base import requires_trainable
    from finetune.errors import PipelineError
    from tasks.contracts import validate_tokenized

    counts = pd.DataFrame({"n_tokens": [5, 3], "n_labels": [5, 3], "n_trainable": [0, 0]})
    validate_tokenized(counts, 16, "tokenize split 'train'", trainable=requires_trainable("none"))
    for targets in ("tokens", "pairs", "unpaired", "labels"):
        with pytest.raises(PipelineError, match="column 'n_trainable' row 0 fails"):
            validate_tokenized(counts, 16, "tokenize split 'train'",
                               trainable=requires_trainable(targets))
    with pytest.raises(ValueError, match="not one of tokens, pairs, unpaired, labels, none"):
        requires_trainable("prompts")
