"""What a training job is handed: the validated config, where to read and write, and the
launch handshake files. One definition for both sides of the torchrun boundary: the train
stage writes a `JobSpec`, every worker reads it.

The engine knows no pipeline layout: `RunPaths` names each input and output explicitly, so the
library runs the same under the DVC stage, a test, or a user's own script.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunPaths:
    """Everything a training run reads or writes, as explicit paths."""

    #: what relative paths in the params file (model.name_or_path, logging.logging_dir,
    #: 'module:name' user code) resolve against
    project_root: Path
    #: a tokenized split saved with datasets (input_ids, labels); None when the train split
    #: is streamed (the job then names a stream source)
    train_data: Path | None
    #: the held-out split for in-training evaluation; None or missing: no evaluation
    eval_data: Path | None
    checkpoints: Path
    #: the trained model or adapter, a normal HF/PEFT folder
    trained: Path
    #: the run's final metrics (JSON)
    metrics_file: Path
    #: train.csv / eval.csv curves
    plots_dir: Path
    #: what identifies the train examples in the checkpoint fingerprint (engine.state.fingerprint):
    #: a tokenized split folder or a stream manifest file; None: `train_data`
    train_identity: Path | None = None
    #: a classification run's class names (a JSON list in id order); None: a language model
    labels: Path | None = None
    #: where the final metrics that measure the machine (wall clock, throughput, memory:
    #: reporters.MEASURED_METRICS) go, so `metrics_file` holds only what the params and data
    #: determine (the pipeline's DVC metrics file, hashed in dvc.lock); None: `metrics_file`
    timings_file: Path | None = None
    #: the format stage's folder of formatted splits (each source's `test.parquet`), whose
    #: generation rows eval.during_training_metrics scores (finetune.datatypes.generations);
    #: None: no generation metrics during training
    formatted: Path | None = None
    #: the train split's per-row columns a method's own stage computed (distill's teacher
    #: stage: the teacher's top-k), row i for row i of `train_data`, read by the run's rows;
    #: None: none
    method_columns: Path | None = None

    def to_json(self) -> dict[str, str | None]:
        return {k: None if v is None else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, str | None]) -> "RunPaths":
        return cls(**{f.name: None if data.get(f.name) is None else Path(data[f.name])
                      for f in fields(cls)})


@dataclass(frozen=True)
class JobSpec:
    """The job file of one torchrun launch."""

    config: dict[str, Any]
    paths: RunPaths
    #: a folder where each failing rank writes its report (engine.process.failures.Report: kind and
    #: one line), from which the launcher explains the failure
    error_dir: str | None = None
    #: rank 0 waits for this file before it writes anything (None: no handshake)
    go_file: str | None = None
    #: rank 0 creates this when it is ready and starts waiting for the go file
    ready_file: str | None = None
    #: 'module:function' (cfg, project_root) -> epoch -> examples, for a streamed train split
    train_stream: str | None = None
    #: a signal name ("SIGUSR1") a scheduler sends before its time limit: every rank then
    #: saves a checkpoint at the next step end and leaves (engine.process.preemption)
    stop_signal: str | None = None
    #: after such a stop the main rank writes here {"step", "checkpoint", "signal"} (JSON),
    #: which tells a stop from a finished run; removed at start
    stopped_file: str | None = None
    #: the environment variable that holds this node's rank (every node reads the same job
    #: file); its value becomes distributed.node_rank
    node_rank_env: str | None = None

    def write(self, path: Path) -> Path:
        data = {**asdict(self), "paths": self.paths.to_json()}
        path.write_text(json.dumps(data))
        return path

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        data = json.loads(Path(path).read_text())
        return cls(**{**data, "paths": RunPaths.from_json(data["paths"])})
