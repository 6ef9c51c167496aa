"""training.deepspeed_config: a ZeRO file users bring is read as this pipeline's FSDP2 keys, the
table printed, and what has no equivalent (or disagrees with the params file) refused in one
line naming the JSON keys and the file (finetune/config/deepspeed.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import ROOT, copy_project
from finetune.config import deepspeed
from finetune.config.loader import validate_raw
from finetune.errors import PipelineError
from flows.cli import main

DATA = {"json_file_path": "x.jsonl"}

#: ZeRO-2 with the optimizer offloaded, as the Trainer/Accelerate examples write it
ZERO2_OFFLOAD = {
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True, "overlap_comm": True, "reduce_scatter": True,
        "contiguous_gradients": True, "allgather_bucket_size": "auto",
        "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": 4,
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}
#: ZeRO-3 in bf16 with its own optimizer and scheduler blocks
ZERO3_BF16 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 10,
        "total_num_steps": 200, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_clipping": 0.5,
}


def config(tmp_path, ds: dict, **sections):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    training = {"deepspeed_config": str(path), **sections.pop("training", {})}
    return validate_raw({"data": DATA, "training": training,
                         "distributed": {"nproc_per_node": 2}, **sections})


def test_zero2_with_optimizer_offload_is_fsdp2_keeping_parameters_with_cpu_offload(tmp_path):
    cfg = config(tmp_path, ZERO2_OFFLOAD, training={"gradient_accumulation_steps": 4})
    d, t = cfg.distributed, cfg.training
    assert (d.strategy, d.fsdp.reshard_after_forward, d.fsdp.cpu_offload) == ("fsdp2", False,
                                                                              True)
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps) == (2, 4)
    assert cfg.logging.logging_steps == 10
    # "auto" leaves the key to the params file: the defaults stand
    assert (t.mixed_precision, t.max_grad_norm) == ("fp32", 1.0)


def test_zero3_bf16_maps_its_optimizer_and_scheduler_and_prints_the_table(tmp_path):
    cfg = config(tmp_path, ZERO3_BF16)
    assert (cfg.distributed.strategy, cfg.distributed.fsdp.reshard_after_forward) == ("fsdp2",
                                                                                      True)
    assert cfg.training.mixed_precision == "bf16" and cfg.training.max_grad_norm == 0.5
    o, s = cfg.optimizer, cfg.scheduler
    # DeepSpeed's Adam decouples weight decay (adam_w_mode defaults to true): torch's AdamW
    assert (o.name, o.learning_rate, o.weight_decay) == ("AdamW", 2e-4, 0.1)
    assert o.kwargs == {"betas": [0.9, 0.95], "eps": 1e-8}
    assert (s.name, s.warmup_steps, cfg.training.max_steps) == ("linear", 10, 200)
    table = deepspeed.describe(str(tmp_path / "ds_config.json"))
    assert ('  zero_optimization.stage: 3 -> distributed.strategy: "fsdp2", '
            "distributed.fsdp.reshard_after_forward: true") in table.splitlines()
    assert '  optimizer.type: "Adam" -> optimizer.name: "AdamW"  (DeepSpeed\'s Adam is AdamW ' \
        "unless adam_w_mode is false)" in table.splitlines()
    # the resolved config validates again as it is (finetune config's output is a params file)
    assert validate_raw(cfg.model_dump(mode="json")) == cfg


def test_what_has_no_equivalent_is_refused_in_one_line_naming_each_json_key(tmp_path):
    ds = {**ZERO3_BF16,
          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e8,
                                "offload_param": {"device": "nvme"}},
          "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
          "activation_checkpointing": {"partition_activations": True}}
    with pytest.raises(PipelineError) as err:
        config(tmp_path, ds)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"<params>: {tmp_path / 'ds_config.json'}: "
                                                "no equivalent here for ")
    for key in ("zero_optimization.stage3_prefetch_bucket_size 500000000.0 (FSDP2 "
                "communicates per unit", 'zero_optimization.offload_param.device "nvme"',
                'optimizer.type "OneBitAdam" (DeepSpeed\'s own optimizer',
                "scheduler.params.warmup_type \"log (DeepSpeed's default)\" (the warmups here "
                "are linear", "activation_checkpointing {"):
        assert key in line, (key, line)


def test_a_mapped_key_the_params_file_sets_otherwise_is_refused_naming_both(tmp_path):
    with pytest.raises(PipelineError, match="ds_config.json and the params file disagree: "
                       "zero_optimization.stage 3 sets distributed.strategy \"fsdp2\", the "
                       "params file \"ddp\"; gradient_clipping 0.5 sets training.max_grad_norm "
                       "0.5, the params file 0.25; keep one of each"):
        config(tmp_path, ZERO3_BF16, training={"max_grad_norm": 0.25},
               distributed={"nproc_per_node": 2, "strategy": "ddp"})
    # the same value is no disagreement
    assert config(tmp_path, ZERO3_BF16, training={"max_grad_norm": 0.5}).training.max_grad_norm \
        == 0.5


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The shipped default with the keys a ZeRO file decides left to it."""
    project = copy_project(tmp_path_factory.mktemp("deepspeed") / "p")
    raw = yaml.safe_load((project / "params/default.yaml").read_text())
    del raw["distributed"]["strategy"], raw["training"]["max_grad_norm"]
    raw["training"]["deepspeed_config"] = "ds/zero3.json"
    (project / "params/default.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (project / "ds").mkdir()
    return project


def test_validate_prints_the_table_and_refuses_an_unmappable_file_with_exit_2(
        project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    zero3 = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}
    (project / "ds/zero3.json").write_text(json.dumps(zero3))
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "ds/zero3.json: DeepSpeed keys as this pipeline's (FSDP2) keys:" in out
    assert "  gradient_clipping: 0.5 -> training.max_grad_norm: 0.5" in out.splitlines()
    (project / "ds/zero3.json").write_text(json.dumps(
        {**zero3, "zero_optimization": {"stage": 3, "sub_group_size": 1e9}}))
    assert main(["validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: params/default.yaml: ds/zero3.json: no equivalent "
                   "here for zero_optimization.sub_group_size 1000000000.0 (FSDP2 communicates "
                   "per unit (each transformer block, distributed.fsdp.shard_modules), not in "
                   "buckets of a size; remove it)"], err


def test_the_docs_table_names_every_json_key_the_module_maps():
    """docs/distributed.md's table lists each top-level key the translation takes."""
    text = (ROOT / "docs/distributed.md").read_text()
    missing = [k for k in deepspeed._TOP if f"`{k}" not in text]
    assert missing == []


def test_false_turns_it_off_and_a_value_that_is_no_file_or_mapping_is_one_line(
        tmp_path, capsys, monkeypatch):
    """The seeds document `deepspeed_config: false` as off: validate accepts it (as null), and
    true or 0 are one line naming the key, exit 2, not an internal error."""
    cfg = validate_raw({"data": DATA, "training": {"deepspeed_config": False}})
    assert cfg.training.deepspeed_config is None
    project = copy_project(tmp_path / "p")
    monkeypatch.chdir(project)
    params = project / "params/default.yaml"
    raw = yaml.safe_load(params.read_text())
    for value, shown in ((False, None), (True, "true"), (0, "0")):
        raw["training"]["deepspeed_config"] = value
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        code = main(["validate"])
        err = capsys.readouterr().err.strip().splitlines()
        if shown is None:
            assert code == 0, err
            continue
        assert code == 2 and err == [
            f"error: params/default.yaml: training.deepspeed_config: {shown} is neither a "
            "DeepSpeed JSON file's path nor its mapping; false or null turns it off"], err
