"""The evaluate stage's contamination check (tasks.contamination): lm-eval's decontamination
convention (13-word n-grams of the normalised text) between the training rows and each
evaluation set. Planted copies of evaluation rows are found, exactly those; clean data reports
0; the stage records it for the held-out split and every harness task (tests/test_harness.py
runs the stage)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

GSM8K = ROOT / "data/source/gsm8k"
PLANTED = [3, 17, 42, 108, 199]  # test rows copied into the training rows


def _texts(split: str) -> list[str]:
    rows = [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines()]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def test_clean_gsm8k_reports_nothing_and_planted_rows_exactly():
    """The shipped GSM8K train rows against its test rows: no overlap. With 5 test rows
    planted among the training rows (one upper-cased and re-punctuated, which the
    normalisation undoes), exactly those 5 are reported, each with the training row that
    holds it; a planted fragment shorter than 13 words is not (lm-eval's rule)."""
    from tasks.contamination import overlaps

    train, test = _texts("train"), _texts("test")
    clean = overlaps(train, {"heldout": test})["heldout"]
    assert clean == {"overlap_fraction": 0.0, "rows": [], "train_rows": []}

    dirty = list(train)
    where = {}
    for k, i in enumerate(PLANTED):
        text = test[i].upper().replace(".", " ;") if k == 0 else test[i]
        dirty.insert(100 * k + 7, text)
    for i in PLANTED:
        where[i] = next(t for t, text in enumerate(dirty)
                        if text in (test[i], test[i].upper().replace(".", " ;")))
    short = " ".join(test[5].split()[:12])
    dirty.append(short)
    found = overlaps(dirty, {"heldout": test, "other": ["nothing in common here"]})
    assert found["heldout"]["rows"] == PLANTED
    assert found["heldout"]["train_rows"] == [where[i] for i in PLANTED]
    assert found["heldout"]["overlap_fraction"] == pytest.approx(5 / len(test))
    assert found["other"] == {"overlap_fraction": 0.0, "rows": [], "train_rows": []}


def test_a_row_is_contaminated_by_any_one_shared_ngram():
    """One shared 13-gram is enough (lm-eval's convention); 12 shared words are not."""
    from tasks.contamination import overlaps

    words = [f"w{i}" for i in range(40)]
    eval_row = " ".join(words[:30])
    assert overlaps([" ".join(["x", *words[10:23], "y"])], {"e": [eval_row]})["e"]["rows"] == [0]
    assert overlaps([" ".join(["x", *words[10:22], "y"])], {"e": [eval_row]})["e"]["rows"] == []
    assert overlaps([" ".join(words[:30])], {"e": [eval_row]}, n=31)["e"]["rows"] == []
