"""The calculator agent's data (params/agent-gsm8k.yaml, params/agent-sft-gsm8k.yaml), made from
GSM8K's arithmetic (MIT): each `<<expr=result>>` annotation of a solution is one task, "Compute
EXPR.", whose answer is GSM8K's result. Writes data/source/gsm8k-agent/:

    python -m preprocess.gsm8k_agent     # from data/source/gsm8k/

The tool's schema is the tool-calling example's, data/source/gsm8k-tools/tools.json (the
calculator environment's method reads as the same schema).

- `sft.jsonl`: the first `--sft` tasks of GSM8K's train split as tool-calling conversations in
  the chat type's raw form (user: the task; assistant: one `calculator` call with the
  expression; tool: the result; assistant: `#### RESULT`): what teaches the model the call's
  form;
- `train.jsonl`: the next `--train` tasks as prompt rows (`prompt`: the user turn, `answer`:
  `#### RESULT`): GRPO's prompts, which the model answers by acting in the calculator
  environment (preprocess/calculator_env.py);
- `test.jsonl`: the first `--test` tasks of GSM8K's test split, the same way: held out.

Why the steps and not the questions: the model of the shipped examples (stories260K, 260K
parameters) writes no correct GSM8K solution, and cannot do arithmetic, but it can learn to copy
an expression into a call and the result into its answer; so the reward comes from acting
through the tool, which is what the example shows. An expression that is not plain arithmetic
(digits, `.`, `+ - * /`, parentheses) or whose result is not a number is left out, and so is a
repeat of an earlier task. No randomness: the output is a function of the input files.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from preprocess.gsm8k_tools import ANNOTATION, ARITHMETIC, NUMBER, TOOL


def tasks(source: list[dict]) -> list[tuple[str, str]]:
    """(expression, result) of each plain-arithmetic annotation of `source`'s solutions, in
    order, each expression once."""
    seen, out = set(), []
    for row in source:
        for match in ANNOTATION.finditer(row["answer"]):
            expression, result = (s.strip() for s in match.groups())
            if (ARITHMETIC.fullmatch(expression) and NUMBER.fullmatch(result)
                    and expression not in seen):
                seen.add(expression)
                out.append((expression, result))
    return out


def question(expression: str) -> str:
    return f"Compute {expression}."


def conversation(expression: str, result: str) -> dict:
    """A task as the chat type's raw row: the call, its result, the answer."""
    return {"messages": [
        {"role": "user", "content": question(expression)},
        {"role": "assistant", "content": "", "tool_calls": [{
            "type": "function", "id": "call_0",
            "function": {"name": TOOL, "arguments": {"expression": expression}}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": TOOL, "content": result},
        {"role": "assistant", "content": f"#### {result}"}]}


def prompt_row(expression: str, result: str) -> dict:
    """A task as a prompt row: the conversation so far and the reference answer."""
    return {"prompt": [{"role": "user", "content": question(expression)}],
            "answer": f"#### {result}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/source/gsm8k"))
    parser.add_argument("--out", type=Path, default=Path("data/source/gsm8k-agent"))
    parser.add_argument("--sft", type=int, default=1024)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    args = parser.parse_args(argv)
    load = lambda split: [json.loads(line) for line in  # noqa: E731
                          (args.source / f"{split}.jsonl").open()]
    train, test = tasks(load("train")), tasks(load("test"))
    made = {"sft": [conversation(*t) for t in train[:args.sft]],
            "train": [prompt_row(*t) for t in train[args.sft:args.sft + args.train]],
            "test": [prompt_row(*t) for t in test[:args.test]]}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in made.items():
        with (args.out / f"{name}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{args.out / f'{name}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
