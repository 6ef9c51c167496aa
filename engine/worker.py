"""torchrun entry point: `python -m torch.distributed.run ... -m engine.worker JOB.json`.

The job file (engine.process.job.JobSpec) carries the already-validated config (so every rank trains
on exactly what the stage validated, even if the params file changes meanwhile), the run's
input and output paths, the go file through which the stage confirms the job (and names the
file rank 0 streams its logged rows to: the stage forwards them to MLflow), and, when the
train split is streamed, the recipe function that opens the stream (the engine takes an
example source; it knows nothing of formats and tokenizers). A `PipelineError` on any rank is
written to the job's error file so the launching stage can re-raise the same one-line message
instead of torchrun's failure dump. A job armed for a scheduler's stop signal (JobSpec.stop_signal,
engine.process.preemption) that saved and stopped on it exits 0, like a finished one; its
stopped file tells the two apart.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from engine.process.failures import Report, describe
from engine.process.job import JobSpec
from engine.process.lifetime import die_with_parent
from engine.process.preemption import StoppedBySignal, armed, remove_stale_stopped_file
from finetune.errors import PipelineError, quiet_import_noise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_import_noise()
    die_with_parent()  # the torchrun agent gone (killed with the stage): so are we
    job = JobSpec.read(Path(argv[0]))
    try:
        run_job(job)
        return 0
    except StoppedBySignal:  # the checkpoint is saved; the process group is torn down
        return 0
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        timeout = job.config.get("distributed", {}).get("ddp_timeout")
        report = describe(exc, int(os.environ.get("RANK", "0")), timeout)
        if report.kind == "crash":  # a bug: the traceback is what a maintainer needs
            traceback.print_exc()
        _report(job, report)
        # Exit here, not by unwinding: freeing the failed run (its traceback holds the DDP
        # reducer) can wait forever on a collective that a hung rank never joins, and every
        # output is written atomically, so there is nothing left to clean up.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.exit_code if isinstance(exc, PipelineError) else 1)


def run_job(job: JobSpec) -> dict:
    """What every rank does with a job: validate its config, open the stream it names, train.
    Tests call it in-process with the job the train stage would write. Armed for the job's
    stop signal first (before the slow imports and the model load), so a signal that comes
    during setup is kept and acted on after the first step; raises StoppedBySignal then."""
    with armed(job.stop_signal, job.stopped_file):
        from engine.recipe.run import train
        from finetune.config import reads, validate_raw
        from finetune.imports import load_object

        cfg = validate_raw(job_config(job), source="train job")
        if cfg.distributed.node_rank == 0 and os.environ.get("LOCAL_RANK", "0") == "0":
            remove_stale_stopped_file(job.stopped_file)  # Dist.is_main, before the group
        reads.start()  # FINETUNE_CONFIG_READS: the train stage's keys include the engine's
        stream = None
        if job.train_stream:  # 'module:function' (cfg, root) -> epoch -> examples
            stream = load_object(job.train_stream, "train job stream")(cfg,
                                                                       job.paths.project_root)
        return train(cfg, job.paths, launcher_go(job), stream)


def job_config(job: JobSpec) -> dict:
    """The job's config as this node runs it: with `node_rank_env`, the node's rank comes from
    that environment variable (every node reads the same job file)."""
    if not job.node_rank_env:
        return job.config
    value = os.environ.get(job.node_rank_env, "")
    if not value.strip().isdigit():
        raise PipelineError(f"job node_rank_env: environment variable {job.node_rank_env} is "
                            f"{'unset' if not value else repr(value)}, not a node rank (an "
                            "integer from 0); the launcher must export it on every node")
    distributed = {**job.config.get("distributed", {}), "node_rank": int(value)}
    return {**job.config, "distributed": distributed}


GO_TIMEOUT_S = 600


def launcher_go(job: JobSpec) -> Callable[[], Path | None]:
    """What every rank calls before rank 0 writes anything: waits for the launching stage's go
    file (its checks passed, its MLflow run is open) and returns the file the stage wants the
    logged rows streamed to (None: it does not). The launcher starts torchrun before those
    checks so that start-up overlaps them; "abort" in the file means a check failed and the
    stage reports it: exit without a word."""
    if not job.go_file:
        return lambda: None

    def wait() -> Path | None:
        if job.ready_file and os.environ.get("RANK", "0") == "0":
            Path(job.ready_file).touch()
        path, deadline = Path(job.go_file), time.monotonic() + GO_TIMEOUT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise PipelineError(f"the train stage never confirmed the job ({job.go_file} "
                                    f"missing after {GO_TIMEOUT_S}s)")
            time.sleep(0.02)
        go = json.loads(path.read_text())
        if "abort" in go:
            raise SystemExit(3)
        return Path(go["relay_file"]) if go.get("relay_file") else None

    return wait


def _report(job: JobSpec, report: Report) -> None:
    print(f"[rank {report.rank}] error: {report.message}", file=sys.stderr, flush=True)
    if job.error_dir:
        try:
            report.write(Path(job.error_dir))
        except OSError:  # the disk the report goes to is full too: stderr still has the line
            pass


if __name__ == "__main__":
    sys.exit(main())
