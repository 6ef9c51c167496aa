"""One module per pipeline stage; each exposes one plain function `stage(ws) -> paths`.

The DVC stage commands (`finetune stage NAME`) and the Prefect tasks call these functions and
nothing else, so there is one code path per step.
"""

from __future__ import annotations

from typing import Callable

STAGES = ("download", "format", "tokenize", "train", "evaluate", "export")


_FUNCTIONS = {
    "download": "tasks.download:download",
    "format": "tasks.format:format_prompts",
    "tokenize": "tasks.tokenize:tokenize",
    "train": "tasks.train:train",
    "evaluate": "tasks.evaluate:evaluate",
    "export": "tasks.export:export",
}


def stage_function(name: str) -> Callable:
    """Import lazily: `finetune validate` should not pay for torch/datasets imports."""
    from finetune.imports import load_object

    return load_object(_FUNCTIONS[name], f"stage {name}")
