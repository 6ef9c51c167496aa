"""Timed windows for bench/gpu.py, the same for every trainer: at each window boundary (an
optimizer step number) the device is synchronised and the host clock read, so a window's time
is the device's time for its steps whatever the trainer overlaps inside it.

`WindowTimer` is our engine's callback (logging.callbacks, kwargs path and boundaries);
`HFWindowTimer` is the transformers TrainerCallback for HF's Trainer and TRL."""

from __future__ import annotations

import json
import time


def _mark(path: str, step: int, boundaries: list[int]) -> None:
    if step not in boundaries:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": step, "t": time.perf_counter()}) + "\n")


class WindowTimer:
    def __init__(self, path: str, boundaries: list[int]):
        self.path, self.boundaries = path, list(boundaries)

    def on_step_end(self, state) -> None:
        _mark(self.path, state.step, self.boundaries)


def hf_timer(path: str, boundaries: list[int]):
    from transformers import TrainerCallback

    class HFWindowTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _mark(path, state.global_step, boundaries)

    return HFWindowTimer()


def windows(path: str, tokens_per_step: list[int]) -> list[float]:
    """Useful tokens/s of each window between consecutive marks (tokens_per_step[i]: step i+1)."""
    marks = [json.loads(x) for x in open(path).read().splitlines()]
    out = []
    for a, b in zip(marks, marks[1:]):
        tokens = sum(tokens_per_step[a["step"]:b["step"]])
        out.append(tokens / (b["t"] - a["t"]))
    return out
