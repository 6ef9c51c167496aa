"""The typed config: defaults validate, every bad-input rule gives one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.config import load_config
from finetune.config.loader import set_keys
from finetune.errors import PipelineError

from helpers import ROOT

# params/deployment.yaml holds the Prefect schedule, not a training config (tested in test_flows).
PARAMS = sorted(p for p in (ROOT / "params").glob("*.yaml") if p.name != "deployment.yaml")


@pytest.mark.parametrize("path", PARAMS, ids=[p.name for p in PARAMS])
def test_every_shipped_params_file_validates(path):
    cfg = load_config(path)
    assert cfg.training.max_grad_norm > 0


def test_at_least_two_documented_examples_besides_default():
    examples = [p for p in PARAMS if p.name != "default.yaml"]
    assert len(examples) >= 2
    for p in examples:
        assert p.read_text().lstrip().startswith("#"), f"{p.name} needs a header comment"


def _error(tmp_path: Path, overrides: dict) -> str:
    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(set_keys(raw, overrides)))
    with pytest.raises(PipelineError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"training.learning_rat": 1}, "unknown key 'training.learning_rat'"),
        ({"training.learning_rate": 1}, "unknown key 'training.learning_rate' in section "
         "'training' (did you mean 'optimizer.learning_rate'?)"),
        ({"training.warmup_steps": 3}, "(did you mean 'scheduler.warmup_steps'?)"),
        # of the sections with the name, the sibling (both rollout sections), not dpo's
        ({"rloo.loss_type": "dapo"}, "unknown key 'rloo.loss_type' in section 'rloo' (did "
         "you mean 'grpo.loss_type'?)"),
        ({"optimizer.learnin_rate": 1}, "did you mean 'optimizer.learning_rate'"),
        ({"trainng.max_steps": 1}, "did you mean 'training'"),
        ({"training.max_steps": "ten"}, "training.max_steps: Input should be a valid integer"),
        ({"training.per_device_train_batch_size": 0}, "per_device_train_batch_size: Input should be greater than 0"),
        ({"training.per_device_train_batch_size": -4}, "greater than 0"),
        ({"training.gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"optimizer.learning_rate": 0}, "learning_rate: Input should be greater than 0"),
        ({"training.max_grad_norm": -1}, "max_grad_norm"),
        ({"scheduler.warmup_steps": -1}, "warmup_steps: Input should be greater than or equal to 0"),
        ({"logging.logging_steps": -1}, "logging_steps"),  # 0 disables (issue 21)
        ({"checkpoint.save_steps": -1}, "save_steps"),
        ({"training.mixed_precision": "fp8"}, "mixed_precision"),
        ({"training.global_batch_size": 64}, "global_batch_size 64 != per_device_train_batch_size 8 x gradient_accumulation_steps 1 x world size 1 = 8"),
        ({"data.prompt_func": "m:f"}, "prompt_template and prompt_func are exclusive"),
        ({"data.completion_func": "m:f"}, "completion_template and completion_func are exclusive"),
        ({"data.json_file_path": "x.jsonl"}, "set exactly one of dataset_name, json_file_path, data_files"),
        ({"distributed.nproc_per_node": 2}, "strategy 'single' runs one process"),
        ({"distributed.strategy": "diloco"}, "strategy 'diloco' needs its outer-loop settings"),
        ({"distributed.fsdp.cpu_offload": True}, "distributed: fsdp: {...} does not combine with strategy single"),
        ({"distributed.strategy": "diloco", "distributed.diloco.diloco_loops": 2},
         "distributed.diloco.inner_steps: required key is missing"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 50,
          "distributed.diloco.diloco_loops": 2},
         "training.max_steps 150 != distributed.diloco.inner_steps 50 x diloco_loops 2 = 100"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
          "distributed.diloco.diloco_loops": 2, "eval.eval_steps": 45},
         "eval.eval_steps 45 must be a multiple of distributed.diloco.inner_steps 75"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 10,
          "distributed.diloco.diloco_loops": 2, "training.max_steps": 20, "eval.eval_steps": 10,
          "checkpoint.save_steps": 15}, "checkpoint.save_steps 15 must be a multiple"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
          "distributed.diloco.diloco_loops": 2,
          "distributed.diloco.local_sgd_start_step": 300, "eval.eval_strategy": "no",
          "checkpoint.save_strategy": "no"}, "the run would never go local"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
          "distributed.diloco.diloco_loops": 2, "distributed.diloco.outer_optimizer": "Nesterov"},
         "'Nesterov' is not a torch.optim optimizer class"),
        ({"distributed.strategy": "diloco", "distributed.nproc_per_node": 2,
          "distributed.diloco.inner_steps": 75, "distributed.diloco.diloco_loops": 2,
          "distributed.diloco.fsdp_group_size": 2,
          "distributed.diloco.post_local_gradient_allreduce": True},
         "set one of them (fsdp_group_size: 1 or post_local_gradient_allreduce: false)"),
        ({"training.construct_model_on": "meta", "model.added_tokens": ["<extra>"]},
         "model.added_tokens: [\"<extra>\"] does not combine with training.construct_model_on meta"),
        ({"training.construct_model_on": "meta", "distributed.strategy": "diloco",
          "distributed.nproc_per_node": 2, "distributed.diloco.inner_steps": 75,
          "distributed.diloco.diloco_loops": 2, "distributed.diloco.fsdp_group_size": 2,
          "eval.eval_steps": 75, "checkpoint.save_steps": 75},
         "distributed.diloco.fsdp_group_size: 2 does not combine with training.construct_model_on meta"),
        ({"distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2,
          "training.mixed_precision": "fp16"},
         "training.mixed_precision: fp16 does not combine with FSDP2 sharding"),
        ({"distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2,
          "distributed.fsdp.param_dtype": "bf16"}, "distributed.fsdp.param_dtype"),
        ({"scheduler.name": "cosine_annealing"}, "scheduler.name"),
        ({"optimizer.name": "Adamw"}, "'Adamw' is not a torch.optim optimizer class"),
        ({"scheduler.warmup_ratio": 0.1}, "warmup_ratio: 0.1 does not combine with warmup_steps"),
        ({"model.load_in_4bit": True, "model.load_in_8bit": True},
         "load_in_8bit: true does not combine with load_in_4bit"),
        ({"checkpoint.load_best_model_at_end": True, "checkpoint.metric_for_best_model":
          "eval_loss", "eval.eval_strategy": "epoch"},
         "load_best_model_at_end: save_strategy steps and eval.eval_strategy epoch differ"),
        ({"checkpoint.load_best_model_at_end": True, "checkpoint.metric_for_best_model":
          "eval_loss", "checkpoint.save_steps": 75},
         "save_steps 75 must be a multiple of eval.eval_steps 50"),
        ({"eval.early_stopping_patience": 3}, "eval.early_stopping_patience: 3 needs checkpoint.metric_for_best_model"),
        ({"checkpoint.metric_for_best_model": "eval_loss", "eval.early_stopping_patience": 3,
          "eval.eval_strategy": "no"}, "checkpoint.metric_for_best_model: eval_loss needs in-training evaluation"),
        ({"checkpoint.metric_for_best_model": "train_loss"}, "checkpoint.metric_for_best_model"),
        ({"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
          "distributed.diloco.diloco_loops": 2, "eval.eval_strategy": "epoch"},
         "eval.eval_strategy: epoch does not combine with distributed.strategy diloco"),
        ({"optimizer.optimizer_groups": {"(": {}}}, "not a valid regular expression"),
        ({"eval.generation_metrics": ["bleu"]}, "eval.generation_metrics"),
        ({"registry.gate_metric": "eval.exact_match", "eval.generation_metrics": []},
         "needs 'exact_match' in eval.generation_metrics"),
        ({"data.streaming": True, "training.max_steps": -1}, "data.streaming: true needs training.max_steps > 0"),
        ({"data.streaming": True, "training.group_by_length": True},
         "training.group_by_length: true does not combine with data.streaming"),
        ({"data.streaming": True, "training.dataloader_num_workers": 2},
         "training.dataloader_num_workers: 2 does not combine with data.streaming"),
        ({"data.streaming": True, "training.dataloader_drop_last": False},
         "training.dataloader_drop_last: false does not combine with data.streaming"),
        ({"data.streaming": True, "eval.eval_strategy": "epoch"},
         "eval.eval_strategy: epoch does not combine with data.streaming without"),
        ({"data.streaming": True, "checkpoint.save_strategy": "epoch"},
         "checkpoint.save_strategy: epoch does not combine with data.streaming without"),
        ({"data.shuffle_buffer": 0}, "data.shuffle_buffer"),
        ({"training.padding_free": True, "training.packing": True},
         "training: packing: true does not combine with padding_free"),
        ({"export.formats": ["adapter"]}, "export.formats: list hf: the HF folder holds"),
        ({"export.formats": ["hf", "adapter", "hf"]}, "export.formats: 'hf' is listed twice"),
        # -1 is the one "unset": another negative once trained a whole epoch
        ({"training.max_steps": -5}, "training.max_steps: a number of optimizer steps > 0, "
         "or -1 for unset"),
        ({"training.num_train_epochs": -2, "training.max_steps": 10},
         "training.num_train_epochs: Input should be greater than or equal to 0"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, overrides, expected):
    assert expected in _error(tmp_path, overrides)


def test_a_hub_dataset_alone_is_a_valid_data_section():
    """The demo files live in params/default.yaml, not in the schema's defaults."""
    from finetune.config import validate_raw

    cfg = validate_raw({"data": {"dataset_name": "openai/gsm8k"}})
    assert cfg.data.dataset_name == "openai/gsm8k" and cfg.data.json_file_path is None


def test_resolved_strategy_is_what_runs():
    from finetune.config import validate_raw

    def resolved(**dist):
        return validate_raw({"data": {"dataset_name": "x"}, "distributed": dist}
                            ).distributed.resolved_strategy

    assert resolved(strategy="ddp") == "single" and resolved(strategy="fsdp2") == "single"
    assert resolved(strategy="ddp", nproc_per_node=2) == "ddp"
    assert resolved(strategy="fsdp2", nnodes=2) == "fsdp2"
    assert resolved(strategy="diloco", diloco={"inner_steps": 2}) == "diloco"
    # fp16 is refused only where FSDP2 really shards (one process runs single-device)
    assert validate_raw({"data": {"dataset_name": "x"}, "training": {"mixed_precision": "fp16"},
                         "distributed": {"strategy": "fsdp2"}})


def test_global_batch_consistent_is_accepted(tmp_path):
    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    raw = set_keys(raw, {"training.global_batch_size": 16,
                                "training.gradient_accumulation_steps": 2})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).training.global_batch_size == 16


OVERRIDDEN = ["training.max_steps=10", "optimizer.learning_rate=3e-4", "data.subset=null",
              "peft.target_modules=[q_proj, v_proj]", "params/default.yaml:peft.r=4",
              "+model.load_in_4bit=false", "++training.seed=7", "~data.num_proc",
              "data.prompt_template='Q: {question}'"]


def test_overrides_mean_what_dvc_exp_run_set_param_means(tmp_path):
    """`-s` is DVC's `-S`: the same parser (Hydra's grammar) and the same struct rules, so
    DVC's own apply_overrides (what `dvc exp run -S params/default.yaml:...` does to the
    file) and ours give the same params."""
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides as dvc_apply

    from finetune.config.overrides import apply_overrides

    source = ROOT / "params/default.yaml"
    (tmp_path / "params").mkdir()
    theirs = tmp_path / "params/default.yaml"
    theirs.write_text(source.read_text())
    by_file = to_path_overrides([o if ":" in o.partition("=")[0] else f"params/default.yaml:{o}"
                                 for o in OVERRIDDEN])
    dvc_apply(theirs, by_file["params/default.yaml"])
    ours = apply_overrides(yaml.safe_load(source.read_text()), OVERRIDDEN, params_path=source)
    assert ours == yaml.safe_load(theirs.read_text())
    assert ours["training"]["max_steps"] == 10 and ours["optimizer"]["learning_rate"] == 3e-4
    assert ours["peft"]["r"] == 4 and ours["model"]["load_in_4bit"] is False
    assert "num_proc" not in ours["data"] and ours["data"]["prompt_template"] == "Q: {question}"


@pytest.mark.parametrize("override, says", [
    ("training.max_steps", "is not [FILE:]KEY=VALUE"),
    ("max_steps=3", "unknown key 'max_steps' (did you mean 'training.max_steps'?)"),
    ("training.lerning_rate=1", "unknown key 'training.lerning_rate' (did you mean "
     "'optimizer.learning_rate'?)"),
    ("model.load_in_4bit=true", "has no key 'model.load_in_4bit' (its default applies); add it "
     "with '+model.load_in_4bit=true'"),
    ("+training.max_steps=3", "already has 'training.max_steps'; change it with "
     "'training.max_steps=3'"),
    ("~training.nope", "has no key 'training.nope' to delete"),
    # a key the file holds as null: Hydra (and so dvc exp run -S) cannot delete it
    ("~data.prompt_func", "sets 'data.prompt_func' to null, which Hydra's delete (as dvc exp "
     "run -S runs it) takes for no key; delete the line from the file, or set a value with "
     "'data.prompt_func=VALUE'"),
    ("training.max_steps=1,2", "is a sweep"),
    ("params/other.yaml:training.max_steps=3", "names params/other.yaml, but the params file is"),
    ("training.max_steps.x=3", "'training.max_steps' is not a section"),
])
def test_bad_override_is_one_line_naming_it(override, says):
    with pytest.raises(PipelineError) as err:
        load_config(ROOT / "params/default.yaml", [override])
    line = str(err.value)
    assert "\n" not in line and f"'{override}'" in line and says in line, line


def test_override_applies_through_loader():
    cfg = load_config(ROOT / "params/default.yaml", ["training.max_steps=7", "peft.r=4"])
    assert cfg.training.max_steps == 7 and cfg.peft.r == 4


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(PipelineError, match="params file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(PipelineError, match="not valid YAML"):
        load_config(bad)


def test_the_deployment_file_is_named_as_such(tmp_path):
    """params/deployment.yaml beside the params files: passed as one, it used to fail with
    'set exactly one of dataset_name, ...' (its first missing section)."""
    msg = str(pytest.raises(PipelineError, load_config, ROOT / "params/deployment.yaml").value)
    assert msg == (f"{ROOT / 'params/deployment.yaml'}: this is a deployment file (the Prefect "
                   "schedule finetune-stack reads: name, cron, params_file), not a params "
                   "file; pass the params file it runs: -p params/default.yaml")
    # a params file with a section is a params file, whatever else it holds
    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**raw, "params_file": "x.yaml"}))
    with pytest.raises(PipelineError, match="unknown key 'params_file' at the top level"):
        load_config(path)


def test_defaults_are_complete_for_dvc(tmp_path):
    """Every params key dvc.yaml tracks exists in params/default.yaml (DVC fails otherwise)."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    for name, stage in dvc["stages"].items():
        for entry in stage.get("params", []):
            for key in entry["params/default.yaml"]:
                node = params
                for part in key.split("."):
                    assert isinstance(node, dict) and part in node, f"{name}: {key} missing"
                    node = node[part]


def test_bare_yaml_no_means_the_choice_no(tmp_path):
    """`save_strategy: no` in YAML 1.1 is the boolean false; it must still mean "no"."""
    from finetune.config import load_config

    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    path = tmp_path / "p.yaml"
    text = yaml.safe_dump(raw).replace("save_strategy: steps", "save_strategy: no")
    path.write_text(text.replace("eval_strategy: steps", "eval_strategy: no"))
    cfg = load_config(path, overrides=[])
    assert cfg.checkpoint.save_strategy == "no" and cfg.eval.eval_strategy == "no"
    assert load_config(path, overrides=["eval.eval_strategy=no"]).eval.eval_strategy == "no"


def test_one_example_params_file_per_dataset_type():
    """Each dataset type has a shipped example that validates and names files that exist."""
    from finetune.datatypes.registry import type_names

    by_type: dict[str, list[str]] = {}
    for path in PARAMS:
        cfg = load_config(path)
        by_type.setdefault(cfg.data.dataset_type, []).append(path.name)
        for file in (cfg.data.data_files or {}).values():
            assert (ROOT / file).exists(), f"{path.name}: {file} is not shipped"
    assert set(type_names()) == {"completion", "text", "chat", "classification", "preference",
                                "prompt", "seq2seq", "unpaired_preference", "vision_chat",
                                "vision_preference"}
    assert set(type_names()) <= set(by_type), by_type
    classification = load_config(ROOT / "params/classification-gsm8k.yaml")
    assert classification.model.auto_class_name == "AutoModelForSequenceClassification"


def test_report_to_takes_the_seeds_log_with_and_one_name():
    """Seeds 000/001 write `log_with: wandb`; HF writes report_to as one name or 'none'."""
    from finetune.config.reporting import LoggingConfig

    assert LoggingConfig.model_validate({"log_with": "wandb"}).report_to == ["wandb"]
    assert LoggingConfig.model_validate({"report_to": "none"}).report_to == []
    assert LoggingConfig.model_validate({"report_to": ["mlflow", "wandb"]}).report_to == [
        "mlflow", "wandb"]
    with pytest.raises(ValueError, match="report_to"):
        LoggingConfig.model_validate({"report_to": "comet"})


def test_save_on_each_node_needs_state_every_node_holds_whole():
    from finetune.config.schema import FinetuneConfig

    data = {"json_file_path": "x.jsonl"}
    ok = FinetuneConfig.model_validate({"data": data, "checkpoint": {"save_on_each_node": True},
                                        "distributed": {"strategy": "ddp", "nnodes": 2}})
    assert ok.checkpoint.save_on_each_node
    with pytest.raises(ValueError, match="save_on_each_node: true does not combine with FSDP2 sharding"):
        FinetuneConfig.model_validate({"data": data, "checkpoint": {"save_on_each_node": True},
                                       "distributed": {"strategy": "fsdp2", "nnodes": 2}})


def test_hf_precision_flags_set_mixed_precision():
    """HF TrainingArguments' `bf16: true` / `fp16: true` work as written; false says nothing;
    both, a non-boolean, or a flag that disagrees with mixed_precision is one line."""
    from finetune.config.training import TrainingConfig

    assert TrainingConfig(bf16=True).mixed_precision == "bf16"
    assert TrainingConfig(fp16=True, bf16=False).mixed_precision == "fp16"
    assert TrainingConfig(bf16=False).mixed_precision == "fp32"
    assert TrainingConfig(bf16=True, mixed_precision="bf16").mixed_precision == "bf16"
    for kwargs, message in (({"bf16": True, "fp16": True}, "bf16 and fp16 are both true"),
                            ({"bf16": True, "mixed_precision": "fp32"},
                             "bf16: true and mixed_precision 'fp32' disagree"),
                            ({"fp16": "yes"}, "fp16: true or false")):
        with pytest.raises(ValueError, match=message):
            TrainingConfig(**kwargs)


@pytest.mark.parametrize("method, data, gate", [
    ("sft", {}, "eval.loss"),
    ("grpo", {"dataset_type": "prompt"}, "eval.reward"),
    ("dpo", {"dataset_type": "preference"}, "eval.preference_accuracy"),
    ("reward", {"dataset_type": "preference"}, "eval.preference_accuracy"),
    ("kto", {"dataset_type": "unpaired_preference"}, "eval.kto_accuracy"),
])
def test_an_unset_gate_metric_is_the_methods_own(method, data, gate):
    """A params file without registry.gate_metric validates for every method (GRPO reports
    no eval.loss: it was refused), and one that names a gate keeps it."""
    from finetune.config import FinetuneConfig

    raw = {"data": {"json_file_path": "x.jsonl", **data}, "training": {"type": method}}
    assert FinetuneConfig.model_validate(raw).registry.gate_metric == gate
    chosen = "eval.sampled_reward" if method == "grpo" else "eval.loss"
    named = FinetuneConfig.model_validate({**raw, "registry": {"gate_metric": chosen}})
    assert named.registry.gate_metric == chosen


@pytest.mark.parametrize("override, says", [
    # names from HF/TRL/Axolotl, answered by meaning (spelling pointed at the wrong key)
    ({"data.dataset_subset": "main"}, "unknown key 'data.dataset_subset' in section 'data' "
     "(did you mean 'data.subset'?)"),
    ({"training.fsdp_config": {}}, "(did you mean 'distributed.fsdp'?)"),
    ({"training.output_dir": "out"}, "unknown key 'training.output_dir' in section 'training' "
     "(HF's output_dir has no key here: each stage writes to the folders dvc.yaml names"),
    ({"checkpoint.save_safetensors": True}, "(HF's save_safetensors has no key here: the "
     "trained model and the export are always written as safetensors)"),
    ({"training.overwrite_output_dir": True}, "to continue a run set "
     "checkpoint.resume_from_checkpoint"),
    ({"distributed.dispatch_batches": False}, "every process reads its own shard"),
    ({"training.average_tokens_across_devices": True}, "normalised by the target tokens of "
     "all processes"),
    ({"training.set_dataset_epoch": True}, "every epoch reshuffles on its own"),
    ({"training.accelerator_config": {}}, "there is no Accelerate here"),
    # values: the choice in another case before the closest spelling
    ({"optimizer.name": "adamw"}, "(did you mean 'AdamW'?)"),
])
def test_a_foreign_name_is_answered_by_meaning(tmp_path, override, says):
    assert says in _error(tmp_path, override)


@pytest.mark.parametrize("override, says", [
    ("data.dataset_subset=main", "(did you mean 'data.subset'?)"),
    ("training.output_dir=out", "(HF's output_dir has no key here: each stage writes"),
    ("training.fsdp_config=x", "(did you mean 'distributed.fsdp'?)"),
])
def test_a_foreign_name_in_an_override_is_answered_by_meaning_too(override, says):
    """`-s` (dvc exp run -S) refuses an unknown key in its own words: the same table answers."""
    from finetune.config.overrides import apply_overrides

    with pytest.raises(PipelineError) as err:
        apply_overrides({"data": {}, "training": {}}, [override], source="p.yaml")
    line, key = str(err.value), override.split("=")[0]
    assert line.startswith(f"override '{override}': unknown key '{key}' (") and says in line, line


def test_every_foreign_rename_names_a_key_of_ours():
    from finetune.config.foreign import NOT_NEEDED, RENAMED
    from finetune.config.loader import all_keys

    keys = set(all_keys())
    for name, ours in RENAMED.items():
        assert ours in keys or any(k.startswith(ours + ".") for k in keys), (name, ours)
    # HF users write them under training (TrainingArguments), where none is a key of ours
    ours = {k.split(".")[1] for k in keys if k.startswith("training.")}
    assert not (set(RENAMED) | set(NOT_NEEDED)) & ours
