"""The no-regression gate (registry.guard_metrics, min_improvement_stderr) and rollback, on a
real MLflow registry (SQLite): `promote` driven in-process with chosen metrics, the recorded
decision read back from the version's tags and its run's gate/decision.json, and
`finetune registry rollback` through the CLI."""

from __future__ import annotations

import json

import pytest
import yaml

from finetune.config.loader import validate_raw
from finetune.config.registry import RegistryConfig
from finetune.errors import PipelineError
from helpers import ROOT, error_line, run_cli

PAIRS = "eval.harness.gsm8k_pairs_local.acc.none"
PAIRS_SE = "eval.harness.gsm8k_pairs_local.acc_stderr.none"
GUARDED = RegistryConfig(gate_metric="eval.loss",
                         guard_metrics=[{"metric": PAIRS, "max_drop": 0.1}])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module; each test registers its own model name."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("gate")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("gate", (root / "mlruns").as_uri())
    source = root / "model"
    source.mkdir()
    return uri, client, exp, source


@pytest.fixture
def model(store, request):
    """(client, name, new_version): new_version(**metrics) registers a version whose run
    logged them."""
    uri, client, exp, source = store
    name = request.node.name.replace("[", "_").replace("]", "")
    client.create_registered_model(name)

    def new_version(metrics: dict[str, float]) -> str:
        run = client.create_run(exp)
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, key, value)
        return str(client.create_model_version(name, str(source), run_id=run.info.run_id).version)

    return client, name, new_version


def _register(model, cfg, metrics: dict[str, float]):
    from tasks.registry import promote

    client, name, new_version = model
    version = new_version(metrics)
    return version, promote(client, name, version, metrics[cfg.gate_metric], cfg, metrics)


def _champion(client, name) -> str:
    return str(client.get_model_version_by_alias(name, "champion").version)


def _recorded(client, name, version) -> tuple[dict, dict, str]:
    """The version's tags, and its run's gate/decision.json and gate/decision.md."""
    import mlflow

    mv = client.get_model_version(name, version)
    with_uri = f"runs:/{mv.run_id}/gate"
    mlflow.set_tracking_uri(client.tracking_uri)
    try:
        decision = mlflow.artifacts.load_dict(f"{with_uri}/decision.json")
        table = mlflow.artifacts.load_text(f"{with_uri}/decision.md")
    finally:
        mlflow.set_tracking_uri("")
    return mv.tags, decision, table


def test_a_guard_dropped_beyond_its_allowance_blocks_promotion_and_says_why(model):
    client, name, _ = model
    v1, first = _register(model, GUARDED, {"eval.loss": 2.0, PAIRS: 0.60})
    assert first.promoted and _champion(client, name) == v1
    # the target improves (loss 2.0 -> 1.5), the guard drops 0.25 > 0.1
    v2, decision = _register(model, GUARDED, {"eval.loss": 1.5, PAIRS: 0.35})
    assert not decision.promoted and _champion(client, name) == v1
    assert "beats champion" in decision.reason and f"guard failed: {PAIRS}" in decision.reason
    tags, recorded, table = _recorded(client, name, v2)
    assert tags["gate.decision"] == "not promoted"
    assert tags[f"gate.guard.{PAIRS}"] == "fail"
    assert tags[f"gate.{PAIRS}"] == "0.35"
    rows = {row["metric"]: row for row in recorded["table"]}
    assert rows["eval.loss"]["verdict"] == "pass" and rows["eval.loss"]["allowed"] == "< 0"
    guard = rows[PAIRS]
    assert (guard["champion"], guard["candidate"], guard["verdict"]) == (0.6, 0.35, "fail")
    assert guard["difference"] == pytest.approx(-0.25) and guard["allowed"] == ">= -0.1"
    assert (f"| {PAIRS} (guard) | 0.6 | 0.35 | -0.25 | >= -0.1 | fail (dropped by 0.25, "
            "more than 0.1) |") in table
    assert table.startswith(f"{name} v{v2}: not promoted")


def test_contamination_above_the_threshold_refuses_even_a_first_model(model):
    """registry.max_contamination: a version whose evaluation found more of an eval set in the
    training rows than allowed is not promoted (a first model neither), the table says which
    set; a clean later one is."""
    client, name, _ = model
    cfg = RegistryConfig(gate_metric="eval.loss", max_contamination=0.01)
    dirty = {"eval.loss": 2.0, "contamination.heldout.overlap_fraction": 0.025,
             "contamination.harness.gsm8k_local.overlap_fraction": 0.0}
    v1, first = _register(model, cfg, dirty)
    assert not first.promoted and "champion" not in client.get_registered_model(name).aliases
    assert first.reason == ("first model: no champion yet; refused: contamination.heldout."
                            "overlap_fraction (0.025 of its rows overlap the training rows)")
    _, recorded, table = _recorded(client, name, v1)
    rows = {row["metric"]: row for row in recorded["table"]}
    assert rows["contamination.heldout.overlap_fraction"]["verdict"] == "fail"
    assert rows["contamination.harness.gsm8k_local.overlap_fraction"]["verdict"] == "pass"
    assert "| contamination.heldout.overlap_fraction (contamination) | - | 0.025 | - | <= 0.01 |" \
        in table
    clean = {**dirty, "contamination.heldout.overlap_fraction": 0.0}
    v2, second = _register(model, cfg, clean)
    assert second.promoted and _champion(client, name) == v2
    # a run whose evaluation measured nothing is refused too
    _, third = _register(model, cfg, {"eval.loss": 1.0})
    assert not third.promoted and "no contamination check" in third.reason


def test_a_drop_within_the_allowance_in_standard_errors_is_promoted(model):
    client, name, _ = model
    cfg = RegistryConfig(gate_metric="eval.loss",
                         guard_metrics=[{"metric": PAIRS, "max_drop_stderr": 1.0}])
    _register(model, cfg, {"eval.loss": 2.0, PAIRS: 0.60, PAIRS_SE: 0.03})
    # allowance 1 se of the difference = sqrt(0.03^2 + 0.04^2) = 0.05; the drop is 0.04
    v2, decision = _register(model, cfg, {"eval.loss": 1.9, PAIRS: 0.56, PAIRS_SE: 0.04})
    assert decision.promoted and _champion(client, name) == v2
    guard = decision.table[1]
    assert guard["verdict"] == "pass" and guard["allowed"] == ">= -0.05 (1 se)"
    tags, _, _ = _recorded(client, name, v2)
    assert tags["gate.decision"] == "promoted" and tags[f"gate.guard.{PAIRS}"] == "pass"
    # 0.06 more (0.10 below the first champion's level) is beyond 1 se now: held
    _, worse = _register(model, cfg, {"eval.loss": 1.8, PAIRS: 0.48, PAIRS_SE: 0.04})
    assert not worse.promoted and _champion(client, name) == v2


def test_the_target_must_improve_beyond_its_noise(model):
    client, name, _ = model
    cfg = RegistryConfig(gate_metric=PAIRS, min_improvement_stderr=2.0)
    v1, _ = _register(model, cfg, {PAIRS: 0.50, PAIRS_SE: 0.03})
    # +0.05 is less than 2 se of the difference (2 * sqrt(2) * 0.03 = 0.0849)
    _, noisy = _register(model, cfg, {PAIRS: 0.55, PAIRS_SE: 0.03})
    assert not noisy.promoted and "does not beat" in noisy.reason and _champion(client, name) == v1
    assert noisy.table[0]["allowed"] == ">= +0.0848528 (2 se = 0.08485)"
    v3, clear = _register(model, cfg, {PAIRS: 0.60, PAIRS_SE: 0.03})
    assert clear.promoted and _champion(client, name) == v3


def test_without_guards_the_reason_is_todays(model):
    client, name, _ = model
    cfg = RegistryConfig(gate_metric="eval.loss", min_improvement=0.05)
    _register(model, cfg, {"eval.loss": 2.0})
    v2, better = _register(model, cfg, {"eval.loss": 1.9})
    assert better.reason == ("eval.loss 1.9 beats champion v1's 2 (lower is better, improvement "
                             "+0.1, minimum 0.05)")
    assert [row["metric"] for row in better.table] == ["eval.loss"]


def test_rollback_restores_the_previous_champion_then_refuses(model, monkeypatch, capsys):
    from flows.cli import main

    client, name, _ = model
    cfg = RegistryConfig(gate_metric="eval.loss")
    v1, _ = _register(model, cfg, {"eval.loss": 2.0})
    v2, _ = _register(model, cfg, {"eval.loss": 1.5})
    _register(model, cfg, {"eval.loss": 1.7})  # not promoted: not in the history
    assert _champion(client, name) == v2
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    params = str(ROOT / "params" / "default.yaml")
    assert main(["registry", "rollback", name, "--reason", "worse in production",
                 "-p", params]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{name}: 'champion' moved from v{v2} back to v{v1} (worse in production)")
    assert _champion(client, name) == v1
    assert client.get_model_version(name, v2).tags["rollback.reason"] == "worse in production"
    assert client.get_registered_model(name).tags["champion_history"] == v1
    # v1 was the first champion: nothing before it (the real console script: exit 2, one line)
    proc = run_cli(ROOT, "registry", "rollback", name, "-p", params,
                   env={"MLFLOW_TRACKING_URI": client.tracking_uri})
    assert error_line(proc) == (f"error: '{name}' has no previous champion before v{v1} "
                                f"(champion history: {v1})")
    assert _champion(client, name) == v1


def test_rollback_of_an_unknown_model_is_one_line(store):
    from tasks.registry import rollback

    _, client, _, _ = store
    with pytest.raises(PipelineError, match=r"^no registered model 'nope' in sqlite:///"):
        rollback(client, "nope", RegistryConfig(), "why")


def _raw(**registry) -> dict:
    raw = yaml.safe_load((ROOT / "params" / "default.yaml").read_text())
    raw["registry"].update(registry)
    return raw


@pytest.mark.parametrize("registry, message", [
    ({"guard_metrics": [{"metric": "eval.perplexity"}]},
     "registry.guard_metrics[0].max_drop: set exactly one of max_drop and max_drop_stderr"),
    ({"guard_metrics": [{"metric": "eval.perplexity", "max_drop": 1, "max_drop_stderr": 1}]},
     "registry.guard_metrics[0].max_drop: set exactly one of max_drop and max_drop_stderr"),
    ({"guard_metrics": [{"metric": "eval.perplexity", "max_drop": 1},
                        {"metric": "eval.exact_match", "max_drop_stderr": 2}]},
     "registry.guard_metrics[1].max_drop_stderr: eval.exact_match reports no standard error "
     "(eval.bootstrap_samples is 0"),
    ({"guard_metrics": [{"metric": "eval.perplexity", "max_drop": -1}]},
     "registry.guard_metrics[0].max_drop: Input should be greater than or equal to 0"),
    ({"guard_metrics": [{"metric": PAIRS, "max_drop": 0.1}]},
     f"registry.guard_metrics[0].metric {PAIRS} names a harness metric, and eval.harness.tasks "
     "is empty"),
    ({"min_improvement_stderr": 1.0},
     "registry.min_improvement_stderr: eval.loss reports no standard error "
     "(eval.bootstrap_samples is 0"),
])
def test_bad_guards_are_refused_in_one_line_naming_the_key(registry, message):
    raw = _raw(**registry)
    raw["eval"]["bootstrap_samples"] = 0  # our own metrics then carry no stderr
    with pytest.raises(PipelineError) as err:
        validate_raw(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_stderr_units_on_our_own_metrics_need_a_bootstrap_stderr():
    """With eval.bootstrap_samples (default 1000) the loss and exact match carry a bootstrap
    stderr, so guards and min_improvement_stderr in standard errors are valid on them; a
    metric of the whole set (a classifier's macro-F1) never has one."""
    validate_raw(_raw(min_improvement_stderr=1.0,
                      guard_metrics=[{"metric": "eval.exact_match", "max_drop_stderr": 2}]))
    raw = _raw(gate_metric="eval.accuracy",
               guard_metrics=[{"metric": "eval.macro_f1", "max_drop_stderr": 2}])
    raw["data"].update(dataset_type="classification", prompt_template=None,
                       completion_template=None)
    raw["eval"]["generation_metrics"] = []
    raw["model"]["auto_class_name"] = "AutoModelForSequenceClassification"
    with pytest.raises(PipelineError, match=r"registry.guard_metrics\[0\].max_drop_stderr: "
                       r"eval.macro_f1 reports no standard error \(not a mean"):
        validate_raw(raw)


def test_the_shipped_guarded_example_is_valid():
    from finetune.config.loader import load_config

    cfg = load_config(ROOT / "params" / "guarded-gsm8k.yaml")
    guard = cfg.registry.guard_metrics[0]
    assert (guard.metric, guard.max_drop_stderr) == (PAIRS, 2.0)
    assert cfg.eval.harness.tasks == ["data/harness/gsm8k_pairs_local.yaml"]
    assert json.loads(json.dumps(cfg.model_dump(mode="json")))["registry"]["guard_metrics"]


def test_a_guard_on_a_lower_is_better_harness_metric_fails_when_it_rises():
    from tasks.gate import judge

    bpb = "eval.harness.gsm8k_answers_ppl.bits_per_byte.none"
    cfg = RegistryConfig(gate_metric="eval.loss", guard_metrics=[{"metric": bpb, "max_drop": 0.1}])
    rise = judge(cfg, {"eval.loss": 2.0, bpb: 1.0}, {"eval.loss": 1.0, bpb: 1.2})[1]
    fall = judge(cfg, {"eval.loss": 2.0, bpb: 1.0}, {"eval.loss": 1.0, bpb: 0.5})[1]
    assert (rise.verdict, rise.allowed, fall.verdict) == ("fail", "<= +0.1", "pass")


@pytest.mark.parametrize("overrides, metric, expected", [
    ({"training.type": "grpo", "data.dataset_type": "prompt",
      "registry.gate_metric": "eval.reward"},
     "eval.reward", False),
    ({"training.type": "kto", "data.dataset_type": "unpaired_preference"},
     "eval.reward_margin", False),
    ({"training.type": "kto", "data.dataset_type": "unpaired_preference"}, "eval.loss", True),
    ({"training.type": "reward", "data.dataset_type": "preference"}, "eval.loss", True),
    ({"training.type": "reward", "data.dataset_type": "preference"}, "eval.reward_margin", True),
    ({"data.dataset_type": "classification", "eval.generation_metrics": []}, "eval.loss", False),
    ({}, "eval.loss", True),
])
def test_a_methods_own_numbers_say_whether_they_carry_a_stderr(overrides, metric, expected):
    """Method.stderr (finetune.config.methods) decides for a method's own numbers; the
    dataset's rule for the rest."""
    import yaml

    from finetune.config.compat import has_stderr
    from finetune.config.loader import set_keys, validate_raw
    from helpers import ROOT

    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    cfg = validate_raw(set_keys(raw, {"registry.register_model": False, **overrides}),
                       source="p.yaml")
    assert has_stderr(cfg, metric) is expected
