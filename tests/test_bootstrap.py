"""Bootstrap standard errors of our own held-out metrics (engine.evaluation.bootstrap): close to
the textbook values where those exist, seeded, off at eval.bootstrap_samples 0; the per-row
loss sums they resample add up to the held-out loss; and the gate can now judge eval.loss in
standard errors (tasks.gate on the metrics as MLflow has them)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.evaluation.bootstrap import mean_stderr, perplexity, ratio_stderr, stderrs
from finetune.config.registry import RegistryConfig
from finetune.datatypes.metrics import exact_match, exact_match_rows, generation_metrics
from helpers import ROOT


def test_the_stderr_of_a_mean_of_bernoulli_rows_is_the_binomial_one():
    n, p = 400, 0.3
    values = (torch.rand(n, generator=torch.Generator().manual_seed(1)) < p).double()
    share = float(values.mean())
    want = math.sqrt(share * (1 - share) / n)
    got = mean_stderr(values, 2000, seed=7)
    assert got == pytest.approx(want, rel=0.1), (got, want)


def test_the_stderr_of_a_ratio_of_sums_is_the_delta_method_one():
    """A token-weighted loss: rows' loss sums over their token counts."""
    g = torch.Generator().manual_seed(2)
    n = 400
    tokens = torch.randint(5, 60, (n,), generator=g).double()
    sums = tokens * (2.0 + torch.rand(n, generator=g, dtype=torch.float64))
    ratio = float(sums.sum() / tokens.sum())
    residual = sums - ratio * tokens
    want = math.sqrt(float((residual ** 2).mean()) / n) / float(tokens.mean())
    got = ratio_stderr(sums, tokens, 2000, seed=7)
    assert got == pytest.approx(want, rel=0.1), (got, want)
    # the perplexity's: exp of each resample's loss, so about exp(loss) x the loss's stderr
    ppl = ratio_stderr(sums, tokens, 2000, seed=7, transform=perplexity)
    assert ppl == pytest.approx(math.exp(ratio) * want, rel=0.1), (ppl, want)


def test_the_same_seed_gives_the_same_stderr_and_zero_samples_none():
    values = torch.rand(50, generator=torch.Generator().manual_seed(3))
    assert mean_stderr(values, 300, seed=5) == mean_stderr(values, 300, seed=5)
    assert mean_stderr(values, 300, seed=5) != mean_stderr(values, 300, seed=6)
    assert mean_stderr(values, 0, seed=5) is None  # eval.bootstrap_samples 0
    assert mean_stderr(values[:1], 300, seed=5) is None  # one row: no spread to measure
    assert stderrs({"exact_match": values.tolist()}, 0, 5) == {}
    assert set(stderrs({"exact_match": values.tolist()}, 300, 5)) == {"exact_match_stderr"}


def test_generation_rows_are_what_the_score_averages():
    preds = ["#### 4", "the answer is 5", "#### 7", "nothing"]
    refs = ["#### 4", "#### 5", "#### 8", "#### 1"]
    rows = exact_match_rows(preds, refs, r"####\s*(.+)")
    assert rows == [1.0, 1.0, 0.0, 0.0]
    assert exact_match(preds, refs, r"####\s*(.+)") == sum(rows) / len(rows) == 0.5
    assert generation_metrics(["exact_match"], [], [], r"####\s*(.+)") == {"exact_match": 0.0}


@pytest.fixture(scope="module")
def tiny():
    """The shipped stories260K and a few held-out rows of its own tokens (the prompt part of
    each ignored, as a completion's is), of uneven lengths so the batch pads."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ROOT / "data/models/stories260K"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    texts = ["Once upon a time there was a little girl.", "Tom had a red ball.",
             "The sun was hot and the dog slept under a big tree all day long.",
             "She smiled.", "They went to the park to play with their friends."]
    rows = []
    for text in texts:
        ids = tok(text)["input_ids"]
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return model, datasets.Dataset.from_list(rows), tok.pad_token_id or 0


def test_per_row_loss_sums_add_up_to_the_held_out_loss(tiny):
    from engine.evaluation.heldout import evaluate_loss

    model, rows, pad = tiny
    plain = evaluate_loss(model, rows, 2, pad)
    result = evaluate_loss(model, rows, 2, pad, per_row=True)
    assert {k: result[k] for k in plain} == plain  # asking for rows changes no number
    sums, tokens = result["row_loss_sums"], result["row_tokens"]
    assert sums.dtype == torch.float64 and len(sums) == len(rows) == len(tokens)
    assert int(tokens.sum()) == plain["tokens"]
    # the first label is never a target (shifted), the next two are ignored
    assert tokens.tolist() == [len(r) - 3 for r in rows["input_ids"]]
    assert float(sums.sum()) / plain["tokens"] == pytest.approx(plain["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="per_row"):
        evaluate_loss(model, rows, 2, pad, per_row=True, loss_sum_fn=lambda *_: 0)


def _evaluated(loss: float, stderr: float | None) -> dict:
    """An eval.json as the evaluate stage writes it (stderr None: as before this change)."""
    entry = {"loss": loss, "perplexity": math.exp(loss), "exact_match": 0.1}
    if stderr is not None:
        entry.update(loss_stderr=stderr, perplexity_stderr=math.exp(loss) * stderr)
    return {"base": dict(entry), "finetuned": entry, "eval_tokens": 100}


@pytest.mark.parametrize("candidate_loss, verdict", [(2.05, "pass"), (2.2, "fail")])
def test_a_loss_guard_in_standard_errors_gets_a_verdict_from_numbers(candidate_loss, verdict):
    """registry.guard_metrics [{metric: eval.loss, max_drop_stderr: 2}] on two evaluations
    keyed as MLflow has them (tasks.evaluate.mlflow_metrics): the allowance is
    2 x sqrt(0.03^2 + 0.04^2) = 0.1 over the champion's 2.0."""
    from tasks.evaluate import mlflow_metrics
    from tasks.gate import FAIL, guard_rows

    cfg = RegistryConfig(gate_metric="eval.exact_match",
                         guard_metrics=[{"metric": "eval.loss", "max_drop_stderr": 2}])
    champion, candidate = (mlflow_metrics(_evaluated(2.0, 0.03)),
                           mlflow_metrics(_evaluated(candidate_loss, 0.04)))
    assert candidate["eval.loss_stderr"] == 0.04 and "eval.base_loss_stderr" in candidate
    [row] = guard_rows(cfg, champion, candidate)
    assert row.verdict == verdict and "no eval.loss_stderr" not in row.why, row
    assert row.allowed.startswith("<= +0.1"), row
    # before: no stderr in the metrics file, so the guard could only fail for want of one
    [before] = guard_rows(cfg, mlflow_metrics(_evaluated(2.0, None)),
                          mlflow_metrics(_evaluated(candidate_loss, None)))
    assert before.verdict == FAIL and before.why == "no eval.loss_stderr for both models"
