"""Is the eval set in the training data? The evaluate stage's contamination check: word n-gram
overlap between the training rows and each evaluation set (the held-out split, every harness
task's documents).

lm-eval's decontamination convention, with its own normalisation and n-grams
(lm_eval.decontamination.janitor): a text is lower-cased, ASCII punctuation is deleted, and it
is split on whitespace into 13-word n-grams (`eval.contamination_ngram`); an evaluation row is
contaminated when any of its n-grams occurs in any training row. A row shorter than n words has
no n-gram and cannot be found (lm-eval's rule too).

Memory follows the evaluation sets (their n-grams, a set of strings), not the training data:
the training splits are read in Arrow record batches and each row's n-grams are looked up, so
a million-row training set costs time, not memory.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Iterable, Iterator

from finetune.parquet_batches import record_batches
from finetune.workspace import Workspace

#: the row count per record batch read from a formatted training split
BATCH_ROWS = 4096


def _janitor(n: int):
    """lm-eval's Janitor (its normalisation and n-grams); its import prints a warning and a
    traceback about an optional C++ module, which says nothing about this check."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from lm_eval.decontamination.janitor import Janitor, word_ngrams

    janitor = Janitor(ngram_n=n)
    return lambda text: set(word_ngrams(janitor.normalize_string(text), n))


def overlaps(train_rows: Iterable[str], eval_sets: dict[str, list[str]], n: int = 13) -> dict:
    """For each evaluation set: `overlap_fraction` (its contaminated rows over its rows),
    `rows` (the contaminated rows' positions in the set) and `train_rows` (for each of those,
    the first training row, by position, that shares an n-gram with it)."""
    ngrams_of = _janitor(n)
    owners: dict[str, list[tuple[str, int]]] = {}  # n-gram -> the eval rows that have it
    for name, texts in eval_sets.items():
        for i, text in enumerate(texts):
            for gram in ngrams_of(text):
                owners.setdefault(gram, []).append((name, i))
    first: dict[tuple[str, int], int] = {}
    if owners:
        for t, text in enumerate(train_rows):
            for gram in ngrams_of(text) & owners.keys():
                for row in owners[gram]:
                    first.setdefault(row, t)
    out = {}
    for name, texts in eval_sets.items():
        rows = sorted(i for s, i in first if s == name)
        out[name] = {"overlap_fraction": len(rows) / len(texts) if texts else 0.0,
                     "rows": rows, "train_rows": [first[(name, i)] for i in rows]}
    return out


def row_texts(parquet: Path) -> Iterator[str]:
    """A formatted split's rows as texts (its text columns joined; a conversation's messages as
    their JSON, whose keys and punctuation the normalisation drops), a record batch at a time."""
    import json

    for batch in record_batches(parquet, BATCH_ROWS):
        for row in batch.to_pylist():
            yield " ".join(v if isinstance(v, str) else json.dumps(v, default=str)
                           for v in row.values()
                           if v is not None and not isinstance(v, (bool, int, float)))


def _formatted(ws: Workspace, role: str) -> dict[str, Path]:
    """Each source's formatted `role` split by its name ("" for a single source)."""
    top = ws.config.data
    files = {}
    for name, _ in top.parts():
        path = (ws.layout.formatted / name if name else ws.layout.formatted) / f"{role}.parquet"
        if path.exists():
            files[name] = path
    return files


def harness_documents(names: list[str], manager, limit) -> dict[str, list[str]]:
    """Each harness task's documents as lm-eval evaluates them (the first `limit` of its eval
    docs), as the text lm-eval's decontamination reads: its decontamination query where the
    task has one, else the prompt and the target."""
    from lm_eval.tasks import get_task_dict

    def tasks(tree: dict) -> Iterator[tuple[str, object]]:
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from tasks(value)
            else:
                yield getattr(key, "group_name", None) or str(key), value

    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        found = dict(tasks(get_task_dict(names, manager)))
    for name, task in found.items():
        docs = list(task.eval_docs)
        if limit is not None:
            docs = docs[: int(limit) if limit >= 1 else int(len(docs) * limit)]
        texts = []
        for doc in docs:
            if task.should_decontaminate():
                texts.append(str(task.doc_to_decontamination_query(doc)))
            else:
                target = task.doc_to_target(doc)
                texts.append(f"{task.doc_to_text(doc)} {target if isinstance(target, str) else ''}")
        out[f"harness.{name}"] = texts
    return out


def measure(ws: Workspace, harness: tuple[list[str], object] | None = None) -> dict:
    """The check on a project: the training rows against the held-out split and, with
    `harness` (the resolved task names and lm-eval's TaskManager), every harness task. A
    mixture's held-out splits are one set per source (`heldout.<source>`), so that a row is
    its position in its own source's test split."""
    n = ws.config.eval.contamination_ngram
    eval_sets = {f"heldout.{name}" if name else "heldout": list(row_texts(f))
                 for name, f in _formatted(ws, "test").items()}
    if harness:
        eval_sets.update(harness_documents(*harness, ws.config.eval.harness.limit))
    train = (t for f in _formatted(ws, "train").values() for t in row_texts(f))
    return {"ngram": n, "sets": overlaps(train, eval_sets, n)}


def metrics(report: dict) -> dict[str, dict[str, float]]:
    """What the metrics file carries (numbers only: `dvc metrics show` lists them)."""
    return {name: {"overlap_fraction": round(s["overlap_fraction"], 6),
                   "overlapping_rows": len(s["rows"])}
            for name, s in report["sets"].items()}
