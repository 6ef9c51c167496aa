"""torchrun entry point: `python -m torch.distributed.run ... -m engine.worker JOB.json`.

The job file carries the already-validated config (so every rank trains on exactly what the
stage validated, even if the params file changes meanwhile), the project root and the MLflow
run, and, when the train split is streamed, the recipe function that opens the stream (the
engine takes an example source; it knows nothing of formats and tokenizers). A `PipelineError`
on any rank is written to the job's error file so the launching stage can re-raise the same
one-line message instead of torchrun's failure dump.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    from engine.loop import train
    from finetune.config import validate_raw
    from finetune.errors import PipelineError

    try:
        cfg = validate_raw(job["config"], source="train job")
        root = Path(job["root"])
        stream = None
        if job.get("train_stream"):  # 'module:function' (cfg, root) -> epoch -> examples
            module, _, name = job["train_stream"].partition(":")
            stream = getattr(importlib.import_module(module), name)(cfg, root)
        train(cfg, root, job.get("mlflow_uri"), job.get("run_id"), stream)
        return 0
    except PipelineError as exc:
        _report(job, str(exc))
        return exc.exit_code
    except Exception as exc:
        _report(job, f"training crashed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1


def _report(job: dict, message: str) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] error: {message}", file=sys.stderr, flush=True)
    error_file = job.get("error_file")
    if error_file and not Path(error_file).exists():
        Path(error_file).write_text(message)


if __name__ == "__main__":
    sys.exit(main())
