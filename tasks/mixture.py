"""Several sources into one train and one test split (`data.sources`).

Sources are mixed after tokenization, where every dataset type has the same columns (a chat
source and a completion source differ until then). The train split is concatenated (every row
once; the trainer shuffles it per epoch) or interleaved with datasets' own
`interleave_datasets`: rows drawn with the sources' weights as probabilities, seeded by
`data.seed`, until the first source runs out or until every source was seen whole
(`stopping_strategy`). Test splits are always concatenated: each source is evaluated on all of
its held-out rows. Each row keeps its source's name (column `source`), so the stats say how
many rows of each source the mixture holds, and the result is the same bytes on every run (the
fingerprints come from the inputs').
"""

from __future__ import annotations

from typing import Any

from finetune.config.data import DataConfig

SOURCE_COLUMN = "source"


def mix(parts: list[tuple[str, Any]], data: DataConfig, role: str,
        source_stats: dict[str, dict]) -> Any:
    """The sources' tokenized `role` splits as one dataset; `source_stats[name][role]` gets
    the rows of each source in it (`rows_in_mixture`)."""
    import datasets

    import pyarrow as pa

    # an Arrow column (the name's bytes and an offset a row), not a Python list of the rows
    named = [ds.add_column(SOURCE_COLUMN, pa.nulls(len(ds), pa.string()).fill_null(name),
                           new_fingerprint=f"{ds._fingerprint}-{name}")
             for name, ds in parts]
    if role == "train" and data.mixing == "interleave":
        weights = {s.name: s.weight for s in data.sources}
        total = sum(weights[name] for name, _ in parts)
        mixed = datasets.interleave_datasets(
            named, probabilities=[weights[name] / total for name, _ in parts], seed=data.seed,
            stopping_strategy=data.stopping_strategy)
    else:
        mixed = datasets.concatenate_datasets(named)
    taken: dict[str, int] = {}  # batch by batch: taking the mixed rows whole copies them
    for batch in mixed.select_columns([SOURCE_COLUMN]).with_format("arrow").iter(10_000):
        for c in batch[SOURCE_COLUMN].value_counts().to_pylist():
            taken[c["values"]] = taken.get(c["values"], 0) + c["counts"]
    for name, _ in parts:
        source_stats[name][role]["rows_in_mixture"] = int(taken.get(name, 0))
    return mixed
