"""One module per pipeline stage; each exposes one plain function `stage(ws) -> paths`.

The DVC stage command (`finetune stage NAME`) calls these functions and nothing else; the
Prefect tasks and `finetune run` go through `dvc repro`, which runs that command. So there is
one code path per step.
"""

from __future__ import annotations

from typing import Callable

STAGES = ("download", "format", "tokenize", "teacher", "train", "evaluate", "export")


_FUNCTIONS = {
    "download": "tasks.download:download",
    "format": "tasks.format:format_prompts",
    "tokenize": "tasks.tokenize:tokenize",
    "teacher": "tasks.teacher:teacher",
    "train": "tasks.train:train",
    "evaluate": "tasks.evaluate:evaluate",
    "export": "tasks.export:export",
}


def stage_function(name: str) -> Callable:
    """Import lazily: `finetune validate` should not pay for torch/datasets imports."""
    from finetune.imports import load_object

    return load_object(_FUNCTIONS[name], f"stage {name}")
