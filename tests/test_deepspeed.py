"""training.deepspeed_config: a ZeRO file users bring is read as this pipeline's FSDP2 keys, the
table printed, DeepSpeed's own tuning keys named in one warning line, and what has no equivalent
(or disagrees with the params file) refused in one line naming the JSON keys and the file
(finetune/config/deepspeed.py)."""

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
    "steps_per_print": 7,
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
    # steps_per_print is DeepSpeed's console print; HF's logging_steps is another key
    assert cfg.logging.logging_steps == validate_raw({"data": DATA}).logging.logging_steps != 7
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
    table, no_effect = deepspeed.describe(str(tmp_path / "ds_config.json"))
    assert no_effect is None
    assert ('  zero_optimization.stage: 3 -> distributed.strategy: "fsdp2", '
            "distributed.fsdp.reshard_after_forward: true") in table.splitlines()
    assert '  optimizer.type: "Adam" -> optimizer.name: "AdamW"  (DeepSpeed\'s Adam is AdamW ' \
        "unless adam_w_mode is false)" in table.splitlines()
    # the resolved config validates again as it is (finetune config's output is a params file)
    assert validate_raw(cfg.model_dump(mode="json")) == cfg


def test_what_has_no_equivalent_is_refused_in_one_line_naming_each_json_key(tmp_path):
    ds = {**ZERO3_BF16,
          "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                "offload_param": {"device": "nvme"}},
          "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                       "warmup_type": "cubic"}},
          "communication_data_type": "fp16"}
    with pytest.raises(PipelineError) as err:
        config(tmp_path, ds)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"<params>: {tmp_path / 'ds_config.json'}: "
                                                "no equivalent here for ")
    for key in ("zero_optimization.zero_quantized_gradients true (ZeRO++ quantizes what is "
                "communicated, which changes the result)",
                'zero_optimization.offload_param.device "nvme"',
                'optimizer.type "OneBitAdam" (DeepSpeed\'s own optimizer',
                'scheduler.params.warmup_type "cubic" (the warmups here are linear or log)',
                'communication_data_type "fp16" (not a DeepSpeed setting'):
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
        {**zero3, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}))
    assert main(["validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: params/default.yaml: ds/zero3.json: no equivalent "
                   "here for zero_optimization.zero_quantized_weights true (ZeRO++ quantizes "
                   "what is communicated, which changes the result)"], err


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


#: HF's documented ZeRO-2 example (transformers' DeepSpeed guide), as users copy it
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
#: HF's documented ZeRO-3 example
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
}


@pytest.mark.parametrize("ds,reshard", [(HF_ZERO2, False), (HF_ZERO3, True)],
                         ids=["zero2", "zero3"])
def test_hf_stock_zero_files_validate_with_one_warning_line_and_their_sharding(
        project, capsys, monkeypatch, ds, reshard):
    """HF's stock files (with the params file leaving the schedule to them, as the fixture
    leaves the strategy): exit 0, one warning line naming each tuning key and why, and the
    resolved run is FSDP2 with the stage's resharding and CPU offload."""
    from finetune.config.loader import load_config

    monkeypatch.chdir(project)
    raw = yaml.safe_load((project / "params/default.yaml").read_text())
    del raw["scheduler"]["name"]
    (project / "params/stock.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (project / "ds/zero3.json").write_text(json.dumps(ds))
    assert main(["validate", "-p", "params/stock.yaml"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ds/zero3.json: no effect here: "), err
    tuning = ["fp16.loss_scale_window", "fp16.hysteresis", "steps_per_print",
              "zero_optimization.reduce_bucket_size" if not reshard else
              "zero_optimization.sub_group_size"]
    assert all(k in err[0] for k in tuning), err
    cfg = load_config(project / "params/stock.yaml")
    d, s = cfg.distributed, cfg.scheduler
    assert (d.strategy, d.fsdp.reshard_after_forward, d.fsdp.cpu_offload) == ("fsdp2", reshard,
                                                                              True)
    # WarmupLR without warmup_type: DeepSpeed's log warmup to a constant rate
    assert (s.name, s.warmup_type, s.warmup_steps) == ("constant_with_warmup", "log",
                                                       raw["scheduler"]["warmup_steps"])
    # the later stages validate again: they do not repeat it
    assert capsys.readouterr().err == ""


def test_zero1_is_fsdp2_keeping_the_gathered_parameters(tmp_path):
    """ZeRO-1 shards the optimizer state; FSDP2 shards it with the gradients (ZeRO-2's
    layout): the same updates, at most ZeRO-1's memory."""
    cfg = config(tmp_path, {"zero_optimization": {"stage": 1}})
    assert (cfg.distributed.strategy, cfg.distributed.fsdp.reshard_after_forward) == ("fsdp2",
                                                                                      False)
    assert "FSDP2 shards the optimizer state with the gradients" in deepspeed.describe(
        str(tmp_path / "ds_config.json"))[0]


def test_log_warmup_is_deepspeeds_warmup_lr():
    """scheduler.warmup_type log: DeepSpeed's WarmupLR rate as its scheduler steps it
    (min + (max - min) * log(n) / log(warmup_num_steps) at optimizer step n >= 1, min 0, its
    first step at min: it starts at last_batch_iteration -1) for the warmup steps, then the
    schedule's own; resume keeps it (the state holds only the step)."""
    import math

    import torch

    from engine.objective.optim import build_scheduler
    from finetune.config.optim import SchedulerConfig

    def rates(cfg, steps=14, state=None):
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=0.5)
        sched = build_scheduler(opt, cfg, total_steps=20)
        if state is not None:
            sched.load_state_dict(state)
            for group, lr in zip(opt.param_groups, sched.get_last_lr()):
                group["lr"] = lr
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out, sched.state_dict()

    log = SchedulerConfig(name="linear", warmup_steps=8, warmup_type="log")
    got, _ = rates(log)
    expect = [0.0] + [0.5 * math.log(i) / math.log(8) for i in range(1, 8)] + [
        0.5 * (20 - i) / 12 for i in range(8, 14)]
    assert got == pytest.approx(expect, abs=1e-12)
    assert got != rates(SchedulerConfig(name="linear", warmup_steps=8))[0]
    _, state = rates(log, steps=5)
    assert rates(log, steps=9, state=state)[0] == pytest.approx(expect[5:], abs=1e-12)
    with pytest.raises(PipelineError, match="scheduler: warmup_type: log does not combine with name"):
        validate_raw({"data": DATA, "scheduler": {
            "warmup_type": "log", "name": "transformers:get_constant_schedule_with_warmup"}})


def test_deprecated_offload_spellings_and_absent_scheduler_params_take_deepspeeds_meaning(
        tmp_path):
    """`cpu_offload: true` is DeepSpeed's old spelling of offload_optimizer on the CPU (not a
    tuning key to drop); a scheduler param the file leaves out is DeepSpeed's default, as HF
    fills only "auto" ones (WarmupLR without warmup_num_steps warms up over 1000 steps)."""
    cfg = config(tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True,
                                                  "cpu_offload_use_pin_memory": True}})
    assert cfg.distributed.fsdp.cpu_offload is True
    cfg = config(tmp_path, {"zero_optimization": {"stage": 2},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-5}}})
    s = cfg.scheduler
    assert (s.name, s.warmup_steps, s.warmup_type, cfg.optimizer.learning_rate) == (
        "constant_with_warmup", 1000, "log", 3e-5)
    with pytest.raises(PipelineError, match=r"scheduler.params.warmup_num_steps null sets "
                       r"scheduler.warmup_steps 1000, the params file 10"):
        config(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-5}}},
               scheduler={"warmup_steps": 10})
