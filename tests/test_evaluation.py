"""Generation metrics, batched generation and the registry's promotion gate (real MLflow)."""

from __future__ import annotations

import pytest
from helpers import ROOT

from finetune.config import FinetuneConfig
from finetune.config.registry import RegistryConfig

GSM8K = r"####\s*(.+)"


@pytest.mark.parametrize("prediction, reference", [
    ("#### 1,000", "#### 1000"),          # thousands separators
    ("#### $18", "#### 18"),              # currency sign
    ("#### 18.0", "#### 18"),             # trailing .0
    ("#### 18.", "#### 18"),              # sentence full stop
    ("#### 2.50", "#### 2.5"),            # trailing zero of a decimal
    ("#### 72 apples", "#### 72"),        # words after the number
    ("so she has 5 left", "#### 5"),      # no marker: the last number of the generation
    ("#### -0", "#### 0"),
    ("#### Paris", "#### paris."),        # non-numeric answers compare as plain text
])
def test_exact_match_normalises_final_answers(prediction, reference):
    from finetune.datatypes.metrics import is_exact_match

    assert is_exact_match(prediction, reference, GSM8K)


@pytest.mark.parametrize("prediction, reference", [
    ("#### 17", "#### 18"),
    ("#### 1,001", "#### 1000"),
    ("no number at all", "#### 4"),
    ("#### 18 then #### 19", "#### 19"),  # the first marked answer counts
])
def test_exact_match_rejects_wrong_answers(prediction, reference):
    from finetune.datatypes.metrics import is_exact_match

    assert not is_exact_match(prediction, reference, GSM8K)


def test_exact_match_is_a_fraction_of_rows():
    from finetune.datatypes.metrics import exact_match

    assert exact_match(["#### 1", "#### 2", "#### 9", "x"], ["#### 1", "#### 2", "#### 3",
                                                            "#### 4"], GSM8K) == 0.5


def test_rouge_equals_the_packages_own_scores():
    from rouge_score import rouge_scorer

    from finetune.datatypes.metrics import generation_metrics

    preds = ["the cat sat on the mat", "a quick brown dog jumps", "nothing in common"]
    refs = ["the cat is sitting on the mat", "the quick brown fox jumps over", "zebra"]
    ours = generation_metrics(["rouge"], preds, refs, GSM8K)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for key in ("rouge1", "rouge2", "rougeL"):
        want = sum(scorer.score(r, p)[key].fmeasure for p, r in zip(preds, refs)) / 3
        assert ours[key] == pytest.approx(want, abs=1e-12)
    assert ours["rouge1"] > ours["rouge2"] > 0  # a real signal, not all zeros
    hand = generation_metrics(["rouge"], ["the cat"], ["the dog"], GSM8K)
    assert hand == {"rouge1": 0.5, "rouge2": 0.0, "rougeL": 0.5}


def test_batched_left_padded_generation_equals_one_by_one():
    """Left padding must not change a greedy continuation (wrong padding side or positions
    would)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.rollout.greedy import encode_prompts, greedy_generate

    path = ROOT / "data/models/stories260K"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    prompts = encode_prompts(tok, ["Once upon a time", "Lily went to the park and she saw a",
                                   "The dog"], None)
    assert len({len(p) for p in prompts}) == 3  # really different lengths: padding matters
    batched = greedy_generate(model, tok, prompts, batch_size=3, max_new_tokens=12)
    single = [greedy_generate(model, tok, [p], batch_size=1, max_new_tokens=12)[0]
              for p in prompts]
    assert batched == single
    assert all(batched)
    assert encode_prompts(tok, ["Once upon a time"], 2)[0] == prompts[0][-2:]


def test_gate_metric_needs_its_generation_metric():
    data = {"dataset_name": "openai/gsm8k"}
    with pytest.raises(ValueError, match="registry.gate_metric eval.rouge1 needs 'rouge'"):
        FinetuneConfig.model_validate({"data": data, "registry": {"gate_metric": "eval.rouge1"}})
    with pytest.raises(ValueError, match="one capture group"):
        FinetuneConfig.model_validate({"data": data, "eval": {"answer_regex": "####"}})
    ok = FinetuneConfig.model_validate({"data": data,
                                        "registry": {"gate_metric": "eval.exact_match"},
                                        "eval": {"generation_metrics": ["exact_match"]}})
    assert ok.registry.higher_wins and not RegistryConfig().higher_wins


@pytest.fixture
def registry_client(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("gate", (tmp_path / "mlruns").as_uri())
    client.create_registered_model("m")
    source = tmp_path / "model"
    source.mkdir()

    def new_version(metric: str, value: float) -> str:
        run = client.create_run(exp)
        client.log_metric(run.info.run_id, metric, value)
        mv = client.create_model_version("m", str(source), run_id=run.info.run_id)
        return str(mv.version)

    return client, new_version


def aliases(client) -> dict[str, str]:
    return {k: str(v) for k, v in client.get_registered_model("m").aliases.items()}


def test_promotion_gate_first_better_worse(registry_client):
    from tasks.registry import promote

    client, new_version = registry_client
    cfg = RegistryConfig(gate_metric="eval.loss", min_improvement=0.05)
    v1 = new_version("eval.loss", 2.0)
    first = promote(client, "m", v1, 2.0, cfg)
    assert first.promoted and "first model" in first.reason
    assert aliases(client) == {"candidate": v1, "champion": v1}

    v2 = new_version("eval.loss", 1.9)  # better by 0.1 >= 0.05
    better = promote(client, "m", v2, 1.9, cfg)
    assert better.promoted and better.champion_version == v1
    assert aliases(client) == {"candidate": v2, "champion": v2}

    v3 = new_version("eval.loss", 2.5)  # worse
    worse = promote(client, "m", v3, 2.5, cfg)
    assert not worse.promoted and "does not beat" in worse.reason
    assert aliases(client) == {"candidate": v3, "champion": v2}

    v4 = new_version("eval.loss", 1.88)  # better, but by less than min_improvement
    small = promote(client, "m", v4, 1.88, cfg)
    assert not small.promoted
    assert aliases(client) == {"candidate": v4, "champion": v2}


def test_promotion_gate_follows_direction(registry_client):
    from tasks.registry import promote

    client, new_version = registry_client
    cfg = RegistryConfig(gate_metric="eval.exact_match")  # higher is better (inferred)
    v1 = new_version("eval.exact_match", 0.30)
    promote(client, "m", v1, 0.30, cfg)
    v2 = new_version("eval.exact_match", 0.25)
    assert not promote(client, "m", v2, 0.25, cfg).promoted
    v3 = new_version("eval.exact_match", 0.40)
    assert promote(client, "m", v3, 0.40, cfg).promoted
    assert aliases(client)["champion"] == v3
    # an explicit direction overrides the inferred one
    lower = RegistryConfig(gate_metric="eval.exact_match", greater_is_better=False)
    v4 = new_version("eval.exact_match", 0.10)
    assert promote(client, "m", v4, 0.10, lower).promoted


def test_unmeasured_model_stays_candidate(registry_client):
    from tasks.registry import promote

    client, new_version = registry_client
    v1 = new_version("eval.loss", 2.0)
    decision = promote(client, "m", v1, None, RegistryConfig())
    assert not decision.promoted and "run the evaluate stage" in decision.reason
    assert aliases(client) == {"candidate": v1}


def test_tracking_uri_block_leaves_no_env_behind(monkeypatch):
    import os

    from tasks.registry import use_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with use_tracking_uri("sqlite:////tmp/somewhere.db"):
        assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:////tmp/somewhere.db"
    assert "MLFLOW_TRACKING_URI" not in os.environ  # later stage subprocesses see no leak
