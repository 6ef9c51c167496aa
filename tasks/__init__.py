"""One module per pipeline stage; each exposes one plain function `stage(ws) -> paths`.

The DVC stage commands (`finetune stage NAME`) and the Prefect tasks call these functions and
nothing else, so there is one code path per step.
"""

from __future__ import annotations

from typing import Callable

STAGES = ("download", "format", "tokenize", "train", "evaluate", "export")


def stage_function(name: str) -> Callable:
    """Import lazily: `finetune validate` should not pay for torch/datasets imports."""
    if name == "download":
        from tasks.download import download as fn
    elif name == "format":
        from tasks.format import format_prompts as fn
    elif name == "tokenize":
        from tasks.tokenize import tokenize as fn
    elif name == "train":
        from tasks.train import train as fn
    elif name == "evaluate":
        from tasks.evaluate import evaluate as fn
    elif name == "export":
        from tasks.export import export as fn
    else:
        raise KeyError(name)
    return fn
