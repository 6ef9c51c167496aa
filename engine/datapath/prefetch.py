"""Micro-batches made ahead of the step, off the thread that drives the device.

With `dataloader_num_workers: 0` the DataLoader collates (and pins) each micro-batch in the
calling thread, so on a GPU the host stops launching kernels while it builds the next batch's
tensors, and the device idles. `Prefetched` pulls from the batch iterator on a background
thread instead, `depth` micro-batches ahead: collation, pinning and the Arrow reads run while
the main thread is launching the current step (torch and Arrow release the GIL in their
heavy parts). The loop then sends each batch with `non_blocking` copies from pinned memory.

Order and resumability are untouched: the thread only runs the same iterator earlier, every
item still carries its (epoch, index) key, and the loop's position advances only for batches
it consumed (engine.reporting.progress). An error in the thread is raised in the loop, at the batch
it would have been raised for. With worker processes (dataloader_num_workers > 0) the
DataLoader already collates ahead and pins on its own thread, so this is not used.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

#: a sentinel for the end of the iterator
_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetched:
    """An iterator over `source`'s items, produced `depth` ahead on a daemon thread."""

    def __init__(self, source: Iterator, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True,
                                        name="finetune-prefetch")
        self._thread.start()

    def _fill(self, source: Iterator) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = next(source)
                except StopIteration:
                    self._put(_DONE)
                    return
                if not self._put(item):
                    return
        except BaseException as exc:  # re-raised in the loop, where the batch was wanted
            self._put(_Failed(exc))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self):
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the item in hand) and drop what it made."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)

    def __del__(self):
        self._stop.set()
