"""Labelled completions from the GSM8K pairs: each pair's chosen solution as a desirable row
(`label: true`) and its rejected one as an undesirable row (`label: false`). Writes
data/source/gsm8k-kto/{train,test}.jsonl (shipped; GSM8K is MIT), the data of
params/kto-gsm8k.yaml:

    python -m preprocess.gsm8k_kto              # from data/source/gsm8k-pairs/: 1200 + 200 rows

Each pair gives two rows, as TRL's `unpair_preference_dataset` unpairs preference data (and
the KTO paper its pairs): the labels are balanced, so desirable_weight and undesirable_weight
of 1 are in TRL's advised range, and the undesirable rows differ from the desirable ones where
the model has to be right (the final answer), which is what a short run on a small model can
learn. The rows keep GSM8K's `question` (the params file renders the prompt from it with
data.prompt_template) and add `completion` and `label`; nothing records which rows were a
pair (a KTO run never reads it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def unpaired(pairs: list[dict]) -> list[dict]:
    """Two labelled rows per pair, the desirable one first."""
    return [{"question": p["question"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/source/gsm8k-pairs"))
    parser.add_argument("--out", type=Path, default=Path("data/source/gsm8k-kto"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = unpaired([json.loads(line) for line in (args.source / f"{split}.jsonl").open()])
        with (args.out / f"{split}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{args.out / f'{split}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
