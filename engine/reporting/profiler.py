"""`logging.profiler`: torch.profiler over a few optimizer steps, so a run can say where a
step's time goes (the ops table) and show it on a timeline (the Chrome/Perfetto trace).

The loop calls `step(global_step)` after each optimizer step; torch.profiler's schedule
(wait, warmup, active, cycles) decides which steps are recorded. Each rank traces its own
process and writes its own files, named by the global steps they cover and the rank, so a
resumed or repeated run adds files beside the earlier ones instead of overwriting them. The
ops table is sorted by self device time on a GPU (by self host time on a CPU): the first rows
are what a step spends most on. Recording adds host work to the traced steps only; the
profiler changes no number the run computes.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Callable

import torch

from finetune.config.reporting import LoggingConfig, ProfilerConfig
from finetune.errors import PipelineError


class StepProfiler:
    """A started torch.profiler.profile with its schedule; leaving its `with` block stops
    it."""

    def __init__(self, cfg: ProfilerConfig, out_dir: Path, device: torch.device, rank: int,
                 log: Callable[[str], None]):
        self.cfg, self.out_dir, self.rank, self.log = cfg, out_dir, rank, log
        self.on_device = device.type == "cuda"
        self.schedule = torch.profiler.schedule(
            wait=cfg.wait_steps, warmup=cfg.warmup_steps, active=cfg.active_steps,
            repeat=cfg.num_cycles)
        self.recorded: list[int] = []  # the global steps of the window being recorded
        self.done = 0  # steps seen (the schedule's step number)
        self.saved: list[Path] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(
            activities=activities, schedule=self.schedule, on_trace_ready=self._save,
            record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack, with_flops=cfg.with_flops)
        self.profile.start()

    @classmethod
    def from_config(cls, cfg: LoggingConfig, root: Path, device: torch.device, rank: int,
                    log: Callable[[str], None]) -> "StepProfiler | None":
        """None when `logging.profiler.enabled` is false."""
        if not cfg.profiler.enabled:
            return None
        return cls(cfg.profiler, traces_dir(cfg, root), device, rank, log)

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Stop the profiler; a window that training ended in the middle of is saved as it
        is. Ended by an error, the profiler stops without a word of its own, and a failure to
        stop cannot hide that error (the worker names it: engine.process.failures)."""
        if exc_type is not None:
            with contextlib.suppress(Exception):
                self.profile.stop()
            return
        self.profile.stop()
        if not self.saved:
            start = self.cfg.wait_steps + self.cfg.warmup_steps + 1
            self.log(f"[train] profiler: nothing recorded: the run took {self.done} steps and "
                     f"the schedule records from its step {start} on; lower "
                     "logging.profiler.wait_steps or warmup_steps")

    def step(self, global_step: int) -> None:
        """After optimizer step `global_step`: note it if it was recorded, then advance."""
        action = self.schedule(self.done)
        if action in (torch.profiler.ProfilerAction.RECORD,
                      torch.profiler.ProfilerAction.RECORD_AND_SAVE):
            self.recorded.append(global_step)
        self.done += 1
        self.profile.step()

    def _save(self, prof: torch.profiler.profile) -> None:
        if not self.recorded:  # torch saves on stop() even when nothing was recorded
            return
        first, last = self.recorded[0], self.recorded[-1]
        self.recorded = []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        steps, said = ((f"step{first:07d}", f"step {first}") if first == last else
                       (f"step{first:07d}-{last:07d}", f"steps {first}-{last}"))
        trace = _unused(self.out_dir / f"trace-{steps}-rank{self.rank}.json")
        prof.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.on_device else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.cfg.row_limit)
        ops = _unused(self.out_dir / f"ops-{steps}-rank{self.rank}.txt")
        ops.write_text(f"{said}, rank {self.rank}, sorted by {sort_by}\n{table}\n")
        self.saved += [trace, ops]
        self.log(f"[train] profiler: {said} traced to {trace} (ops table: {ops.name})")


def traces_dir(cfg: LoggingConfig, root: Path) -> Path:
    """Where the traces go: `profiler.output_dir`, else `logging_dir/profile` (relative to
    the project root)."""
    return root / (cfg.profiler.output_dir or f"{cfg.logging_dir}/profile")


def check_traces_dir(cfg: LoggingConfig, root: Path, outputs: tuple[Path, ...]) -> None:
    """Before any process starts (engine.preflight): a folder the traces cannot be written to
    is one line naming the key, not a crash at the first traced step; so is one inside the
    run's `outputs` (the trained model, which DVC hashes, and the checkpoints a resume reads):
    traces there would make them differ from run to run, and be replaced with them."""
    folder = traces_dir(cfg, root)
    for output in outputs:
        if folder.resolve().is_relative_to(output.resolve()):
            raise PipelineError(
                f"logging.profiler.output_dir: {folder} is inside the run's output {output}, "
                "which every run rewrites (and the trained model would not reproduce bit for "
                "bit); put the traces elsewhere (default: logging_dir/profile)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        key = "output_dir" if cfg.profiler.output_dir else "output_dir (null: logging_dir/profile)"
        raise PipelineError(f"logging.profiler.{key}: cannot write traces to {folder} "
                            f"({exc.strerror or exc})") from None


def _unused(path: Path) -> Path:
    """`path`, or `path` with -2, -3, ... before its suffix if a file is already there."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate
