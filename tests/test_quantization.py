"""Low precision (issue 20): QAT trains fake-quantised and ships a converted model whose loss
the evaluate stage reports; every QAT recipe trains on a CPU, and fp8 and a conversion the machine
lacks kernels for are one line."""

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


@pytest.mark.parametrize("recipe", ["int4-weight-only", "float8-dynamic-act-float8-weight"])
def test_every_qat_recipe_trains_on_a_cpu(tokenized, tmp_path, recipe, capsys):
    """QAT has no hardware gate: the fake quantiser runs on CPU for every recipe. Only the
    conversion needs kernels this machine lacks, so the evaluate stage says it skipped the
    quantised loss, and the export (quantized not listed) ships the QAT-trained weights."""
    run, proc = train_here(tokenized, tmp_path / "q", {
        **BASE, "training.qat_recipe": recipe, "export.formats": ["hf", "adapter"]})
    assert f"QAT {recipe} (group size 32): linear layers fake-quantised" in proc.stdout
    plain, _ = train_here(tokenized, tmp_path / "p", BASE)
    assert losses(run)[0] != losses(plain)[0]  # the fake quantiser is in the forward
    if recipe == "int4-weight-only":  # one evaluate is enough to show the skipped conversion
        stages_here(run, "evaluate", "export")
        assert (f"quantized loss not measured: training.qat_recipe {recipe} cannot be "
                "converted on cpu (torchao: ") in capsys.readouterr().out
        metrics = json.loads((run / "data/metrics/eval.json").read_text())
        assert "quantized" not in metrics and metrics["finetuned"]["loss"] > 0
        assert (run / "data/export/adapter").is_dir()
        assert not (run / "data/export/quantized").exists()


@pytest.mark.parametrize("recipe, reason", [
    ("int4-weight-only", "Requires mslk"),
    ("float8-dynamic-act-float8-weight", "Float8 dynamic quantization requires CUDA"),
])
def test_a_conversion_this_machine_cannot_do_is_one_line_before_training(recipe, reason):
    """The one refusal left: export.formats asks for the converted model (the default lists
    quantized) and torchao has no kernel for the recipe on this device, with torchao's reason."""
    from engine.modeling.quantization import check_low_precision
    from finetune.config.schema import FinetuneConfig

    params = {"data": {"json_file_path": "x.jsonl"}, "training": {"qat_recipe": recipe}}
    with pytest.raises(PipelineError, match=(
            f"training.qat_recipe {recipe}: QAT trains on cpu, but export.formats quantized "
            f"cannot convert it here .torchao: {reason}.*drop quantized from export.formats")):
        check_low_precision(FinetuneConfig.model_validate(params), torch.device("cpu"))
    params["export"] = {"formats": ["hf", "adapter"]}
    check_low_precision(FinetuneConfig.model_validate(params), torch.device("cpu"))
    params = {**params, "training": {"qat_recipe": "int8-dynamic-act-int4-weight"}}
    params.pop("export")
    check_low_precision(FinetuneConfig.model_validate(params), torch.device("cpu"))


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
