"""A model kind is one module plus a registry line (issue 67): the loop, the strategies and
the stages ask the kind (engine.kinds) what differs by the family of model trained. A toy kind
written in one project file, with its own loss, trains through
all six stages without an edit to any product file; the built-in kinds answer as the branches
they replaced did."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (copy_project, logged_column, plugin_run, product_changes,
                     sft_first_step_loss, write_params)

# The kind and the dataset type that trains it, as a project would write them.
TOY_KIND = '''
"""A causal LM trained with label smoothing: the kind owns its loss, the loop is unchanged."""
import torch

from engine.kinds.causal_lm import CausalLM
from engine.objective.loss import FullLoss
from finetune.datatypes.base import ModelTask
from finetune.datatypes.completion import CompletionType

SMOOTHING = 0.1


def smoothed_sum(logits, labels):
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100,
                                             reduction="sum", label_smoothing=SMOOTHING)


class SmoothedLoss(FullLoss):
    name = "smoothed"
    eval_loss_sum = staticmethod(smoothed_sum)

    def loss_sum(self, output, labels):
        return smoothed_sum(output.logits, labels)


class SmoothedLM(CausalLM):
    name = "smoothed_lm"

    def loss(self, model, cfg, device, amp, user_fn=None):
        return SmoothedLoss()


class SmoothedCompletion(CompletionType):
    name = "smoothed-completion"
    task = ModelTask("AutoModelForCausalLM", "CAUSAL_LM", "text-generation", False,
                     kind="toy_kind.py:SmoothedLM")
'''


@pytest.fixture(scope="module")
def toy_kind_run(tmp_path_factory):
    return plugin_run(tmp_path_factory.mktemp("kind"), "toy_kind.py", TOY_KIND,
                      {"data.dataset_type": "toy_kind.py:SmoothedCompletion",
                       "training.max_steps": 6})


def test_a_model_kind_in_one_file_trains_through_all_six_stages(toy_kind_run):
    losses = logged_column(toy_kind_run, "loss")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    evaluation = json.loads((toy_kind_run / "data/metrics/eval.json").read_text())
    assert evaluation["finetuned"]["loss"] < evaluation["base"]["loss"], evaluation
    assert (toy_kind_run / "data/export/adapter_config.json").exists() or (
        toy_kind_run / "data/export/config.json").exists()
    assert product_changes(toy_kind_run) == sorted(
        [" M params/default.yaml", "?? toy_kind.py"])


def test_the_toy_kinds_loss_is_its_own(toy_kind_run, tmp_path):
    """The logged first-step loss is the smoothed one: plain SFT on the same rows and the same
    first step logs a different number."""
    plain, smoothed = sft_first_step_loss(toy_kind_run, tmp_path), logged_column(toy_kind_run,
                                                                                  "loss")[0]
    assert smoothed > plain + 1e-3, (smoothed, plain)  # smoothing adds the uniform term


def _config(overrides: dict):
    import yaml

    from finetune.config.loader import set_keys, validate_raw
    from helpers import ROOT

    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    return validate_raw(set_keys(raw, overrides), source="p.yaml")


@pytest.mark.parametrize("overrides, kind", [
    ({}, "CausalLM"),
    ({"data.dataset_type": "seq2seq", "registry.register_model": False}, "Seq2SeqLM"),
    ({"data.dataset_type": "classification", "eval.generation_metrics": []},
     "SequenceClassifier"),
    ({"training.type": "reward", "data.dataset_type": "preference"}, "SequenceClassifier"),
])
def test_the_config_names_the_kind_the_engine_trains(overrides, kind):
    from engine.kinds import kind_of

    assert type(kind_of(_config(overrides))).__name__ == kind


def test_an_unknown_kind_is_one_line_naming_the_known_ones():
    from engine.kinds import KINDS
    from finetune.errors import PipelineError

    with pytest.raises(PipelineError, match=r"model kind 'causal': no such model kind "
                       r"\(registered: causal_lm, image_text_to_text, seq2seq_lm, "
                       r"sequence_classifier.*did you mean 'causal_lm'"):
        KINDS.get("causal")


def test_the_kinds_answer_as_the_branches_they_replaced():
    """What a batch gives the forward, how its labels sit, and which run a method uses."""
    from engine.datapath.data import count_targets, label_shift, model_inputs
    from engine.kinds import KINDS
    from engine.kinds.seq2seq_lm import collate_seq2seq

    rows = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [5], "labels": [8]}]
    batch = collate_seq2seq(rows, pad_id=0, start_id=1)
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask", "decoder_input_ids"}
    assert label_shift(batch) == 0 and count_targets(batch) == 3
    assert batch["decoder_input_ids"].tolist() == [[1, 8], [1, 8]]  # start, then labels
    assert batch["labels"].tolist() == [[8, 9], [8, -100]]
    assert label_shift({"labels": torch.zeros(1, 2)}) == 1
    assert KINDS.get("sequence_classifier").run_classes == {
        "sft": "engine.recipe.classifier.run:ClassifierRun"}
    assert KINDS.get("causal_lm").run_classes == {} == KINDS.get("seq2seq_lm").run_classes
    assert KINDS.get("seq2seq_lm")().generated_from(7) == 1
    assert KINDS.get("causal_lm")().generated_from(7) == 7


def test_a_data_stage_hands_types_the_kinds_processor(tmp_path):
    """A text kind's processor is the tokenizer itself; a kind with its own (a
    vision-language model's AutoProcessor) reaches every dataset type through DataContext."""
    from engine.kinds import KINDS
    from finetune.workspace import Workspace
    from helpers import ROOT
    from tasks.format import data_context

    ws = Workspace.load(ROOT / "params/default.yaml")
    ctx = data_context(ws)
    assert ctx.processor is ctx.tokenizer

    class Wrapped:
        def __init__(self, tok):
            self.tokenizer = tok

    class WithProcessor(KINDS.get("causal_lm")):
        def processor(self, tokenizer, model_cfg, root):
            return Wrapped(tokenizer)

    KINDS.register("causal_lm", WithProcessor)
    try:
        ctx = data_context(ws)
        assert isinstance(ctx.processor, Wrapped) and ctx.processor.tokenizer is ctx.tokenizer
    finally:
        KINDS.register("causal_lm", "engine.kinds.causal_lm:CausalLM")


def test_a_kind_that_does_not_load_is_one_line_at_validate(tmp_path):
    """A dataset type naming a kind whose module is missing: `finetune validate` says which,
    exit 2, before any stage runs."""
    from helpers import error_line, run_cli

    project = copy_project(tmp_path / "p")
    (project / "toy_kind.py").write_text(TOY_KIND.replace('kind="toy_kind.py:SmoothedLM"',
                                                          'kind="missing_kind.py:Nothing"'))
    write_params(project, {"data.dataset_type": "toy_kind.py:SmoothedCompletion"})
    result = run_cli(project, "validate")
    assert result.returncode == 2, result.stdout + result.stderr
    assert error_line(result).startswith(
        "error: data.dataset_type toy_kind.py:SmoothedCompletion: model kind: cannot import "
        "'missing_kind.py:Nothing'"), error_line(result)
