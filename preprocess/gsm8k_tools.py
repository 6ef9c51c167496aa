"""Tool-calling conversations from GSM8K: each calculator annotation of a solution becomes a
call and its result. Writes data/source/gsm8k-tools/{train,test}.jsonl and tools.json (shipped;
GSM8K is MIT), the data of params/tools-gsm8k.yaml:

    python -m preprocess.gsm8k_tools            # from data/source/gsm8k/, 265 + 50 rows

GSM8K marks every computation of a solution as `<<expr=result>>result`. Each row is a `messages`
conversation in the chat type's raw form (docs/data.md, "Tool calls and reasoning"): the
question as the user turn; per annotation an assistant turn holding the solution's text up to
it (may be "") and one `calculator` call with the expression, then the tool turn with the
result; last an assistant turn with the rest of the solution, ending `#### N`. The assistant
turns' text joined is the plain solution with the annotations removed. A solution without
annotations is the plain two-turn conversation. Rows with an annotation that is not plain
arithmetic (digits, `.`, `+ - * /`, parentheses) or whose result is not a number are left out,
and so are rows whose rendering (params/templates/calculator-chat.jinja, the tools line
included) is longer than `--max-tokens` tokens of stories260K's tokenizer: a truncated row
loses its final answer and its last EOS, the parts that teach the model to finish. The first
300 (50) rows that pass are kept: 265 of GSM8K's 1000 train rows fit in 512 tokens, 59 of its
200 test rows. No randomness: the output is a function of the input files.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ANNOTATION = re.compile(r"<<([^=>]*)=([^>]*)>>")
ARITHMETIC = re.compile(r"[\d.+\-*/() ]+")
NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)")
TOOL = "calculator"
TOOLS = [{"type": "function", "function": {
    "name": TOOL,
    "description": "Evaluate an arithmetic expression (numbers, + - * /, parentheses).",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. 48/2 or (3+4)*2"}},
                   "required": ["expression"]}}}]


def conversation(question: str, answer: str) -> list[dict] | None:
    """The messages of one GSM8K row (None: an annotation that is not plain arithmetic)."""
    messages: list[dict] = [{"role": "user", "content": question}]
    start = 0
    for k, match in enumerate(ANNOTATION.finditer(answer)):
        expression, result = (s.strip() for s in match.groups())
        if not (ARITHMETIC.fullmatch(expression) and NUMBER.fullmatch(result)):
            return None
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": answer[start:match.start()],
                         "tool_calls": [{"type": "function", "id": call_id, "function": {
                             "name": TOOL, "arguments": {"expression": expression}}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": TOOL,
                         "content": result})
        start = match.end()
    messages.append({"role": "assistant", "content": answer[start:]})
    return messages


def rows(source: list[dict], limit: int, fits=lambda messages: True) -> list[dict]:
    """The first `limit` rows of `source` that convert and fit."""
    out = []
    for row in source:
        messages = conversation(row["question"], row["answer"])
        if messages is not None and fits(messages):
            out.append({"messages": messages})
        if len(out) == limit:
            break
    return out


def token_budget(tokenizer: Path, template: Path, max_tokens: int):
    """messages -> whether their rendering with `template` and TOOLS is at most `max_tokens`
    tokens of `tokenizer` (BOS included, as the tokenize stage counts)."""
    from transformers import AutoTokenizer

    from finetune.datatypes.conversation import normalise, tool_schemas

    tok, text = AutoTokenizer.from_pretrained(tokenizer), template.read_text()
    tools = tool_schemas(TOOLS, "TOOLS")

    def fits(messages: list[dict]) -> bool:
        rendered = tok.apply_chat_template(normalise(messages, None, "row"), tools=tools,
                                           chat_template=text, tokenize=False)
        return len(tok(rendered)["input_ids"]) <= max_tokens

    return fits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/source/gsm8k"))
    parser.add_argument("--out", type=Path, default=Path("data/source/gsm8k-tools"))
    parser.add_argument("--train", type=int, default=300)
    parser.add_argument("--test", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="leave out rows longer than this (0: keep every row)")
    parser.add_argument("--tokenizer", type=Path, default=Path("data/models/stories260K"))
    parser.add_argument("--template", type=Path,
                        default=Path("params/templates/calculator-chat.jinja"))
    args = parser.parse_args(argv)
    fits = (token_budget(args.tokenizer, args.template, args.max_tokens) if args.max_tokens
            else lambda messages: True)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, limit in (("train", args.train), ("test", args.test)):
        source = [json.loads(line) for line in (args.source / f"{split}.jsonl").open()]
        made = rows(source, limit, fits)
        with (args.out / f"{split}.jsonl").open("w") as f:
            for row in made:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{args.out / f'{split}.jsonl'}: {len(made)} rows")
    (args.out / "tools.json").write_text(json.dumps(TOOLS, indent=2) + "\n")
    print(f"{args.out / 'tools.json'}: {len(TOOLS)} tool")


if __name__ == "__main__":
    main()
