"""Built-in callbacks that report training: console, DVC plots CSVs, JSON lines, TensorBoard,
a progress bar, and the row relay through which the launching stage logs to MLflow. `build_reporters` picks them from `logging`.

The CSVs are written to a staging file and renamed at the end, so a failed run never clobbers
the previous run's curves; the history also rides in checkpoints so a resumed run's plots (and
its JSON-lines log) are whole.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
from pathlib import Path

from finetune.datatypes.metrics import ROUGE_KEYS, TOOL_CALL_KEYS
from engine.reporting.callbacks import Callback, CallbackList, TrainState, load_user_callback

TRAIN_FIELDS = ["step", "epoch", "loss", "learning_rate", "grad_norm", "num_input_tokens_seen"]
#: the loop's own values of a training row that train.csv leaves out (the console, MLflow and
#: the JSON lines have them)
NOT_PLOTTED = ("comm_bytes_per_step",)
EVAL_FIELDS = ["step", "eval_loss"]
#: eval.during_training_metrics' scores: eval.csv has a column for each logged (and its
#: `_stderr`; the lm-eval metrics it names too, eval_harness.*); a method's own eval_
#: statistics stay off the curves, as before
GENERATED = ("exact_match", *ROUGE_KEYS, *TOOL_CALL_KEYS)
#: logged values that measure the machine (wall clock, throughput, memory), not the run: the
#: console, MLflow and the JSON lines have them; train.csv and the checkpoints' history leave
#: them out, so two runs of the same params write the same bytes there (DVC hashes the
#: trained model's, git tracks train.csv)
MEASURED = ("tokens_per_second", "memory_rss_mb", "cuda_max_memory_allocated_mb",
            "eval_seconds")
#: the final metrics of that kind (RunPaths.timings_file)
MEASURED_METRICS = ("train_runtime", "first_step_unix", "train_tokens_per_second",
                    "train_steps_per_second", "speed_metrics_start_step", "memory_rss_mb",
                    "cuda_max_memory_allocated_mb", "eval_seconds")


def measured(key: str) -> bool:
    """A machine measurement: MEASURED, or a method's own timing (GRPO's time/generation)."""
    return key in MEASURED or key.startswith("time/")


def without_measured(row: dict) -> dict:
    return {k: v for k, v in row.items() if not measured(k)}


def _rounded(logs: dict) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}


class History(Callback):
    """Every logged row (kept in checkpoints); `train.csv` / `eval.csv` for `dvc plots`."""

    def __init__(self, plots_dir: Path, rows: list[dict] | None = None):
        self.plots_dir = plots_dir
        self.rows: list[dict] = list(rows or [])

    def on_log(self, state: TrainState, logs: dict) -> None:
        self.rows.append({"step": state.step, **_rounded(logs)})

    def on_train_end(self, state: TrainState) -> None:
        self.plots_dir.mkdir(parents=True, exist_ok=True)
        # a trainer type's own statistics (DPO's rewards/..., GRPO's reward, entropy, ...)
        # get columns too
        own = [k for k in dict.fromkeys(k for row in self.rows if "loss" in row for k in row)
               if k not in TRAIN_FIELDS and k not in NOT_PLOTTED and not measured(k)]
        # eval.during_training_metrics: eval_<metric> and its stderr, in the order logged
        scored = [k for k in dict.fromkeys(k for row in self.rows if "eval_loss" in row
                                           for k in row)
                  if k.removeprefix("eval_").removesuffix("_stderr") in GENERATED
                  or k.startswith("eval_harness.")]
        for name, fields, key in (("train.csv", TRAIN_FIELDS + own, "loss"),
                                  ("eval.csv", EVAL_FIELDS + scored, "eval_loss")):
            final = self.plots_dir / name
            tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                for row in self.rows:
                    if key in row:
                        writer.writerow(row)
            os.replace(tmp, final)


class Console(Callback):
    """`[train] step=10 loss=... ` lines on stdout (what DVC and Prefect logs show); another
    node's lines (log_on_each_node) say which node they come from."""

    def __init__(self, prefix: str = "[train]"):
        self.prefix = prefix

    def on_log(self, state: TrainState, logs: dict) -> None:
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in {"step": state.step, **_rounded(logs)}.items())
        print(f"{self.prefix} {shown}", file=sys.stdout, flush=True)


class RowRelay(Callback):
    """Streams every logged row, as a JSON line, to the launching stage, which forwards it to
    its trackers (MLflow, `report_to: mlflow`). The worker never imports mlflow: that import
    cost ~1.5 s on the first step's critical path and ~100 MB of RSS per run, and a slow
    tracking server can no longer stall a training step."""

    def __init__(self, path: Path):
        self.fh = open(path, "a")

    def on_log(self, state: TrainState, logs: dict) -> None:
        self.fh.write(json.dumps({"step": state.step, **logs}) + "\n")
        self.fh.flush()

    def on_train_end(self, state: TrainState) -> None:
        self.fh.close()


class JsonLines(Callback):
    """One JSON object per logged row, flushed as it happens (`tail -f` friendly). A resumed
    run first rewrites the rows its checkpoint knows, so the file never has duplicates."""

    def __init__(self, path: Path, rows: list[dict]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "w")
        for row in rows:
            self._write(row)

    def _write(self, row: dict) -> None:
        self.fh.write(json.dumps(row, sort_keys=True) + "\n")
        self.fh.flush()

    def on_log(self, state: TrainState, logs: dict) -> None:
        self._write({"step": state.step, **_rounded(logs)})

    def on_train_end(self, state: TrainState) -> None:
        self.fh.close()


class TensorBoard(Callback):
    def __init__(self, log_dir: Path):
        self.log_dir, self.writer = log_dir, None

    def on_train_begin(self, state: TrainState) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops the events the interrupted one logged after its checkpoint
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=state.step or None)

    def on_log(self, state: TrainState, logs: dict) -> None:
        for key, value in logs.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, state.step)

    def on_train_end(self, state: TrainState) -> None:
        self.writer.close()


class ProgressBar(Callback):
    """A step bar (tqdm or rich) on stderr with the last loss."""

    def __init__(self, kind: str = "tqdm", file=None):
        self.kind, self.file, self.bar = kind, file or sys.stderr, None

    def on_train_begin(self, state: TrainState) -> None:
        if self.kind == "rich":
            from rich.console import Console as RichConsole
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[loss]}"),
                                console=RichConsole(file=self.file))
            self.bar.start()
            self.task = self.bar.add_task("train", total=state.max_steps, completed=state.step,
                                          loss="")
        else:
            from tqdm import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.step, desc="train",
                            file=self.file, dynamic_ncols=True)

    def on_step_end(self, state: TrainState) -> None:
        if self.kind == "rich":
            self.bar.update(self.task, completed=state.step)
        else:
            self.bar.update(state.step - self.bar.n)

    def on_log(self, state: TrainState, logs: dict) -> None:
        if "loss" not in logs:
            return
        if self.kind == "rich":
            self.bar.update(self.task, loss=f"loss {logs['loss']:.4f}")
        else:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)

    def on_train_end(self, state: TrainState) -> None:
        if self.kind == "rich":
            self.bar.stop()
        else:
            self.bar.close()


@contextlib.contextmanager
def work_bar(total: int, desc: str, log_cfg):
    """A bar like training's (tqdm or rich, `logging.progress_bar`, on stderr) over a stage's
    batches outside training: the evaluate stage's losses and generations, minutes on a CPU.
    Shown when the training bar would be (`logging.disable_tqdm`); yields `advance(n=1)`."""
    if not progress_enabled(log_cfg.disable_tqdm):
        yield lambda n=1: None
        return
    if log_cfg.progress_bar == "rich":
        from rich.console import Console as RichConsole
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)

        with Progress(TextColumn(desc), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=RichConsole(file=sys.stderr)) as bar:
            task = bar.add_task(desc, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def progress_enabled(disable_tqdm: bool | None, stream=None) -> bool:
    """HF semantics: on unless disable_tqdm; with disable_tqdm unset, only on a terminal."""
    if disable_tqdm is not None:
        return not disable_tqdm
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


def build_reporters(log_cfg, plots_dir: Path, root: Path, relay: Path | None,
                    rows: list[dict]) -> CallbackList:
    """The main process's callbacks, in the order they run."""
    history = History(plots_dir, rows)
    callbacks: list = [history]
    if log_cfg.log_level in ("debug", "info"):
        callbacks.append(Console())
    if progress_enabled(log_cfg.disable_tqdm):
        callbacks.append(ProgressBar(log_cfg.progress_bar))
    logging_dir = root / log_cfg.logging_dir
    if relay is not None:  # the stage asked for the rows (it logs them to MLflow)
        callbacks.append(RowRelay(relay))
    if "jsonl" in log_cfg.report_to:
        callbacks.append(JsonLines(logging_dir / "train_log.jsonl", history.rows))
    if "tensorboard" in log_cfg.report_to:
        callbacks.append(TensorBoard(logging_dir / "tensorboard"))
    callbacks.extend(load_user_callback(spec) for spec in log_cfg.callbacks)
    return CallbackList(callbacks)
