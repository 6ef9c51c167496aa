"""The compatibility table (finetune/config/compat.py) is the one place cross-option rules live:
each row refuses its own example (and nothing else does), the machine's rows refuse a CPU, and
no validator elsewhere raises on a combination of options."""

from __future__ import annotations

import ast

import pytest
import torch
import yaml

from helpers import ROOT
from finetune.config import compat
from finetune.config.loader import set_keys, validate_raw
from finetune.errors import PipelineError

DEFAULT = yaml.safe_load((ROOT / "params/default.yaml").read_text())
ROWS = [r for r in compat.RULES if r.scope != "machine"]


def _validate(overrides: dict):
    return validate_raw(set_keys(DEFAULT, overrides), source="p.yaml")


def _row_id(rule) -> str:
    return f"{rule.scope}:{rule.key}:{getattr(rule, 'where', getattr(rule, 'needs', None))}"


@pytest.mark.parametrize("rule", ROWS, ids=[f"{i}-{compat.full_key(r)}"
                                            for i, r in enumerate(ROWS)])
def test_each_row_refuses_its_example_and_no_other_row_does(rule, monkeypatch):
    assert rule.example, f"{compat.full_key(rule)}: a row needs an example that it refuses"
    with pytest.raises(PipelineError) as refused:
        _validate(rule.example)
    line = str(refused.value)
    assert "\n" not in line
    named = rule.key if rule.scope in ("config", "data.sources") else rule.key.split(".")[0]
    assert named in line, line
    # without this row the example is valid: the row, and no other rule, refuses it
    monkeypatch.setattr(compat, "RULES", [r for r in compat.RULES if r is not rule])
    _validate(rule.example)


MACHINE = [r for r in compat.RULES if r.scope == "machine"]
USED = {"training.mixed_precision": {"training.mixed_precision": "fp16"},
        "model.load_in_4bit": {"model.load_in_4bit": True},
        "model.load_in_8bit": {"model.load_in_8bit": True},
        "training.enable_activation_offloading": {"training.enable_activation_offloading": True},
        "training.gc_threshold": {"training.gc_threshold": 0.6},
        "training.sdpa_backend": {"training.sdpa_backend": ["cudnn_attention"]},
        "training.fp8_recipe": {"training.fp8_recipe": "rowwise"},
        "training.use_liger_kernel": {"training.use_liger_kernel": True},
        "distributed.backend": {"distributed.backend": "nccl"}}


@pytest.mark.parametrize("rule", MACHINE, ids=[r.key for r in MACHINE])
def test_each_machine_row_refuses_a_cpu(rule):
    cfg = _validate(USED[rule.key])
    with pytest.raises(PipelineError, match=f"^{rule.key}: .* needs "):
        compat.check_machine(cfg, torch.device("cpu"))
    compat.check_machine(_validate({}), torch.device("cpu"))  # unused: nothing to refuse
    if rule.key != "training.fp8_recipe":  # which GPU: asked of the GPU itself
        compat.check_machine(cfg, torch.device("cuda"))


def test_every_machine_row_is_exercised():
    assert {r.key for r in MACHINE} == set(USED)


def _after_validators(tree: ast.AST):
    """Functions decorated model_validator(mode="after") (they see several keys at once)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "model_validator"
                        and any(k.arg == "mode" and getattr(k.value, "value", "") == "after"
                                for k in deco.keywords)):
                    yield node


def test_no_rule_on_several_options_is_raised_outside_the_table():
    """Validators that see several keys at once run the table; they raise nothing themselves
    (single-key field validators may, and the seed-name translation before validation)."""
    raising = []
    for path in sorted((ROOT / "finetune/config").glob("*.py")):
        if path.name == "compat.py":
            continue
        for fn in _after_validators(ast.parse(path.read_text())):
            if any(isinstance(n, ast.Raise) for n in ast.walk(fn)):
                raising.append(f"{path.name}:{fn.name}")
    assert raising == []
    # the engine and the stages do not refuse combinations of options on their own either
    phrases = ("does not combine with", "needs a CUDA GPU", "are exclusive")
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]:
        text = path.read_text()
        assert not any(p in text for p in phrases), path


def test_the_reference_says_where_an_option_applies():
    from finetune.config.reference import render

    table = render()
    row = next(line for line in table.splitlines() if line.startswith("| `training.packing`"))
    assert "not with distributed.strategy pipeline" in row
    assert "not with a classification dataset" in row
    assert compat.applies_to("training.fuse_optim_with_backward").count("not with") == 3


def test_a_section_declares_its_own_rows_beside_it():
    """The dpo section's rows live in finetune/config/preference.py (compat.add_rows): they are
    in the table, so validation, the reference and the row tests above see them; a row of
    another section's scope is refused at registration."""
    from finetune.config import preference
    from finetune.config.reference import render

    assert preference.ROWS and all(any(r is row for r in compat.RULES) for row in preference.ROWS)
    assert not any(r.scope == "dpo" for r in compat.RULES if r not in preference.ROWS)
    row = next(line for line in render().splitlines()
               if line.startswith("| `dpo.precompute_ref_log_probs`"))
    assert "not with loss_type simpo" in row
    with pytest.raises(PipelineError) as refused:
        _validate({"dpo.loss_type": "simpo", "dpo.precompute_ref_log_probs": True})
    assert str(refused.value) == (
        "p.yaml: dpo: precompute_ref_log_probs: true does not combine with loss_type simpo "
        "(simpo is reference-free: there are no reference log-probabilities to precompute)")
    stray = compat.Refuse("training", "packing", compat.When("x", lambda t: True), "why")
    with pytest.raises(ValueError, match="another section's scope"):
        compat.add_rows("dpo", [stray])
    assert stray not in compat.RULES


def test_the_gate_is_checked_only_when_the_run_registers():
    """A GRPO run that registers nothing is not refused for the gate metric it would use
    (eval.loss by default, which GRPO does not report); a registering one still is."""
    grpo = {"training.type": "grpo", "data.dataset_type": "prompt"}
    _validate({**grpo, "registry.register_model": False})
    _validate({**grpo, "registry.register_model": False,
               "registry.guard_metrics": [{"metric": "eval.loss", "max_drop": 0.1}]})
    with pytest.raises(PipelineError, match="registry.gate_metric"):
        _validate(grpo)
