"""Preference pairs from GSM8K: chosen = the reference solution, rejected = the same solution
with a wrong final answer. Writes data/source/gsm8k-pairs/{train,test}.jsonl (shipped; GSM8K is
MIT), the data of params/dpo-gsm8k.yaml:

    python -m preprocess.gsm8k_pairs            # from data/source/gsm8k/, 600 + 100 pairs

Each row keeps GSM8K's `question` (the params file renders the prompt from it with
data.prompt_template, as the default run does) and adds `chosen` and `rejected` completions.
The wrong answer is the right one plus an offset in 1..9 drawn from a seeded generator, put in
the `#### N` line and in the last step's calculator result (`<<a+b=N>>N`), so the rejected side
differs exactly where the model has to be right. Rows whose answer is not an integer are left out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

FINAL = re.compile(r"#### (-?\d+)\s*$")


def wrong_answer(answer: str, rng: random.Random) -> str | None:
    """The solution with its final integer replaced (None: no integer final answer)."""
    match = FINAL.search(answer)
    if match is None:
        return None
    right = match.group(1)
    wrong = str(int(right) + rng.randint(1, 9))
    body = answer[:match.start()]
    # the last step's result, when its calculator annotation gives the answer: <<a+b=N>>N
    steps = list(re.finditer(rf"=({re.escape(right)})>>({re.escape(right)})\b", body))
    if steps:
        last = steps[-1]
        body = f"{body[:last.start()]}={wrong}>>{wrong}{body[last.end():]}"
    return f"{body}#### {wrong}"


def pairs(rows: list[dict], limit: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for row in rows:
        rejected = wrong_answer(row["answer"], rng)
        if rejected is not None:
            out.append({"question": row["question"], "chosen": " " + row["answer"],
                        "rejected": " " + rejected})
        if len(out) == limit:
            break
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/source/gsm8k"))
    parser.add_argument("--out", type=Path, default=Path("data/source/gsm8k-pairs"))
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, limit in (("train", args.train), ("test", args.test)):
        rows = [json.loads(line) for line in (args.source / f"{split}.jsonl").open()]
        made = pairs(rows, limit, args.seed)
        with (args.out / f"{split}.jsonl").open("w") as f:
            for row in made:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{args.out / f'{split}.jsonl'}: {len(made)} pairs")


if __name__ == "__main__":
    main()
