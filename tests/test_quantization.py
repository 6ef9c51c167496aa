"""Low precision (issue 20): QAT trains fake-quantised and ships a converted model whose loss
the evaluate stage reports; fp8 and the GPU-only QAT recipes are one line on a CPU."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import BASE, losses, stages_here, train_here

from finetune.config.training import TrainingConfig
from finetune.errors import PipelineError

QAT = {**BASE, "training.qat_recipe": "int8-dynamic-act-int4-weight"}


def test_qat_trains_fake_quantised_and_the_export_ships_it_converted(tokenized, tmp_path):
    from engine.datapath.data import load_tokenized
    from engine.evaluation.heldout import evaluate_loss
    from engine.modeling.quantization import load_quantized

    run, proc = train_here(tokenized, tmp_path / "q", QAT)
    assert "QAT int8-dynamic-act-int4-weight (group size 32): linear layers fake-quantised" \
        in proc.stdout
    assert "mlp.down_proj" in proc.stdout.split("left in full precision")[1]  # 172 inputs
    plain, _ = train_here(tokenized, tmp_path / "p", BASE)
    assert losses(run)[0] != losses(plain)[0]  # the fake quantiser is in the forward
    stages_here(run, "evaluate", "export")
    metrics = json.loads((run / "data/metrics/eval.json").read_text())
    assert metrics["quantized"]["loss"] != metrics["finetuned"]["loss"]
    folder = run / "data/export/quantized"
    info = json.loads((folder / "quantization.json").read_text())
    assert info["recipe"] == "int8-dynamic-act-int4-weight" and info["group_size"] == 32
    assert all("down_proj" in name for name in info["skipped_layers"]) and info["skipped_layers"]
    assert (run / "data/export/config.json").exists()  # the normal export is still there
    model = load_quantized(folder)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert type(q_proj).__name__ != "Parameter" and "Int" in type(q_proj).__name__
    test = load_tokenized(run / "data/tokenized/test")
    reloaded = evaluate_loss(model, test, 16, 0)["loss"]
    assert round(reloaded, 6) == pytest.approx(metrics["quantized"]["loss"], abs=2e-6)


@pytest.mark.parametrize("training, message", [
    ({"qat_recipe": "int4-weight-only"}, "int4-weight-only: its quantised kernels need a CUDA"),
    ({"qat_recipe": "float8-dynamic-act-float8-weight"}, "float8 .SM >= 8.9"),
])
def test_what_needs_a_gpu_is_one_line_here(training, message):
    from engine.modeling.quantization import check_low_precision

    with pytest.raises(PipelineError, match=message):
        check_low_precision(TrainingConfig.model_validate(training), torch.device("cpu"))


def test_fp8_needs_a_gpu_of_compute_capability_8_9():
    from finetune.config.compat import check_machine
    from finetune.config.schema import FinetuneConfig

    cfg = FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"},
                                         "training": {"fp8_recipe": "rowwise"}})
    with pytest.raises(PipelineError, match="training.fp8_recipe: rowwise needs a CUDA GPU of "
                       "compute capability >= 8.9"):
        check_machine(cfg, torch.device("cpu"))


def test_fp8_and_qat_are_exclusive():
    with pytest.raises(ValueError, match="qat_recipe: int4-weight-only does not combine with fp8_recipe"):
        TrainingConfig.model_validate({"fp8_recipe": "rowwise",
                                       "qat_recipe": "int4-weight-only"})
