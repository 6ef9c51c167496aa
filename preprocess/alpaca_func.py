"""Prompt functions for instruction datasets, in the seeds' layout: `data.prompt_func:
preprocess/alpaca_func:create_alpaca_prompt` names this file and function. Files in
`preprocess/` are a dependency of the format stage in dvc.yaml, so editing one reformats.

Add your own next to it: a function that takes one row (a dict of the raw columns) and returns
the prompt string.
"""

HEADER = ("Below is an instruction that describes a task{extra}. Write a response that "
          "appropriately completes the request.\n\n")


def create_alpaca_prompt(row: dict) -> str:
    """The Stanford Alpaca prompt: instruction, the optional input, then '### Response:'."""
    context = (row.get("input") or "").strip()
    if context:
        return (HEADER.format(extra=", paired with an input that provides further context")
                + f"### Instruction:\n{row['instruction']}\n\n### Input:\n{context}\n\n"
                "### Response:\n")
    return HEADER.format(extra="") + f"### Instruction:\n{row['instruction']}\n\n### Response:\n"
