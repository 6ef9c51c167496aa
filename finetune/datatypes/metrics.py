"""Evaluation metrics the dataset types report: exact match of a final answer and ROUGE (from
the rouge-score package) on generations, accuracy and macro-F1 on a classifier's predictions.

Exact match compares *normalised final answers*, not whole texts: a GSM8K reference ends in
`#### 1,000` and a model may write `#### $1000.00`; both are the number 1000. Numbers compare
as decimals (commas, `$`, a trailing `.` or `.0` do not matter); anything else compares as
lower-cased, whitespace-collapsed text.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

#: eval.generation_metrics choices; rouge reports the three ROUGE_KEYS
GENERATION_METRICS = ("exact_match", "rouge", "tool_calls")
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")
#: what the tool_calls generation metric reports (finetune.datatypes.tool_calls), on the
#: held-out turns that call tools (the chat type)
TOOL_CALL_KEYS = ("tool_name_match", "tool_arguments_match")
CLASSIFICATION_METRICS = ("accuracy", "macro_f1")
#: preference pairs (finetune.datatypes.preference): how a model ranks chosen over rejected
PREFERENCE_METRICS = ("preference_accuracy", "reward_margin", "likelihood_accuracy",
                      "logp_margin")
#: unpaired preferences (finetune.datatypes.unpaired_preference): whether a model's implicit
#: reward puts each held-out completion on its label's side of 0
UNPAIRED_METRICS = ("kto_accuracy", "desirable_accuracy", "undesirable_accuracy",
                    "reward_margin")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _number(token: str) -> str | None:
    try:
        value = Decimal(token.replace(",", ""))
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))  # 18.0 -> 18, -0 -> 0
    return format(value.normalize(), "f")  # 2.50 -> 2.5


def normalize_answer(text: str) -> str:
    """The canonical form of one answer: the first number in it, else its plain text."""
    cleaned = text.strip().replace("$", "")
    match = NUMBER.search(cleaned)
    if match:
        number = _number(match.group())
        if number is not None:
            return number
    return " ".join(cleaned.rstrip(".").lower().split())


def extract_answer(text: str, pattern: str) -> str | None:
    """The answer part of a text: `pattern`'s group 1 (first match; its first line), else the
    last number in the text (models that skip the `####` marker), else None."""
    match = re.search(pattern, text)
    if match and match.group(1) is not None:
        lines = match.group(1).strip().splitlines()
        return lines[0] if lines else ""
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def is_exact_match(prediction: str, reference: str, pattern: str) -> bool:
    want = extract_answer(reference, pattern)
    got = extract_answer(prediction, pattern)
    if want is None or got is None:
        return False
    return normalize_answer(got) == normalize_answer(want)


def exact_match_rows(predictions: list[str], references: list[str], pattern: str
                     ) -> list[float]:
    """1.0 for each row whose final answers agree, else 0.0."""
    return [float(is_exact_match(p, r, pattern))
            for p, r in zip(predictions, references, strict=True)]


def exact_match(predictions: list[str], references: list[str], pattern: str) -> float:
    """Fraction of rows whose final answers agree."""
    return mean(exact_match_rows(predictions, references, pattern))


def rouge_rows(predictions: list[str], references: list[str]) -> dict[str, list[float]]:
    """Each pair's ROUGE-1/2/L F1 (rouge-score, Porter stemming), as the package computes it."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    rows: dict[str, list[float]] = {key: [] for key in ROUGE_KEYS}
    for pred, ref in zip(predictions, references, strict=True):
        scores = scorer.score(ref, pred)
        for key in ROUGE_KEYS:
            rows[key].append(scores[key].fmeasure)
    return rows


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 over the pairs."""
    return means(rouge_rows(predictions, references))


def mean(values: list[float]) -> float:
    """The mean over rows; 0.0 for no rows (a metric of nothing scores nothing)."""
    return sum(values) / len(values) if values else 0.0


def means(rows: dict[str, list[float]]) -> dict[str, float]:
    return {key: mean(values) for key, values in rows.items()}


def generation_rows(names: list[str], predictions: list[str], references: list[str],
                    pattern: str) -> dict[str, list[float]]:
    """Each generation metric's per-row values (every one is a mean over rows: its row values
    also give its bootstrap stderr in the evaluate stage)."""
    out: dict[str, list[float]] = {}
    if "exact_match" in names:
        out["exact_match"] = exact_match_rows(predictions, references, pattern)
    if "rouge" in names:
        out.update(rouge_rows(predictions, references))
    return out


def generation_metrics(names: list[str], predictions: list[str], references: list[str],
                       pattern: str) -> dict[str, float]:
    return means(generation_rows(names, predictions, references, pattern))


def classification_metrics(predicted: list[int], true: list[int], num_labels: int) -> dict:
    """Accuracy and macro-F1 (each class's F1, averaged with equal weight: a classifier that
    always answers the majority class scores low even on skewed data). A class with neither
    predictions nor examples is left out of the average."""
    if not true:
        return {"accuracy": 0.0, "macro_f1": 0.0}
    correct = sum(p == t for p, t in zip(predicted, true))
    f1s = []
    for c in range(num_labels):
        tp = sum(p == c and t == c for p, t in zip(predicted, true))
        fp = sum(p == c and t != c for p, t in zip(predicted, true))
        fn = sum(p != c and t == c for p, t in zip(predicted, true))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": correct / len(true), "macro_f1": sum(f1s) / len(f1s)}
