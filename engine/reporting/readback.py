"""Logged values read from the device without stopping it.

A logging row needs the window's summed loss and the gradient norm, which live on the device.
Reading them with `.item()` / `.tolist()` makes the host wait until the GPU has run every kernel
queued so far; then the GPU waits for the host to launch the next step's kernels. On a
launch-bound step (a small model, short rows) that wait is most of the step. Here the values
are copied into pinned host memory with a non-blocking copy and an event is recorded after
it; the loop emits the row once the event has completed (checked without waiting at every
step), so the row of step k usually reaches the reporters during step k+1. The loop waits
only where it must: before an evaluation, a checkpoint and the end of training (so a saved
history and the final metrics hold every row), and when a new logging step comes before the
last row arrived.

Off CUDA there is nothing to overlap: the values are read at once and the row is emitted at its
own step, as before.
"""

from __future__ import annotations

import torch


class Readback:
    """`values` (a 1-D tensor) on its way to the host."""

    def __init__(self, values: torch.Tensor):
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def ready(self) -> bool:
        """Arrived (never blocks)."""
        return self._event is None or self._event.query()

    def values(self) -> list[float]:
        """The values on the host (waits for the copy if it has not arrived)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
