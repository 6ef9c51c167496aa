"""Where each stage reads and writes, and how it writes without losing earlier results.

The data layout is fixed (it is what `dvc.yaml` declares as deps and outs); the params file
chooses inputs and settings, never where intermediate artifacts live. A test keeps `dvc.yaml`
and these paths in step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from finetune.config import FinetuneConfig, load_config
from finetune.errors import PipelineError
from finetune.config.loader import project_root_for

DEFAULT_PARAMS = "params/default.yaml"


@dataclass(frozen=True)
class Layout:
    """Stage artifacts, relative to the project root."""

    root: Path

    @property
    def raw(self) -> Path:
        return self.root / "data/raw"

    @property
    def formatted(self) -> Path:
        return self.root / "data/formatted"

    @property
    def tokenized(self) -> Path:
        return self.root / "data/tokenized"

    @property
    def checkpoints(self) -> Path:
        return self.root / "data/checkpoints"

    @property
    def trained(self) -> Path:
        return self.root / "data/trained"

    @property
    def export(self) -> Path:
        return self.root / "data/export"

    @property
    def metrics(self) -> Path:
        return self.root / "data/metrics"

    @property
    def plots(self) -> Path:
        return self.root / "data/plots"

    @property
    def params_valid(self) -> Path:
        """Written by dvc.yaml's validate stage (`finetune validate --mark`); every step's
        DVC dependency, so `dvc repro` checks the whole params file first."""
        return self.root / "data/params-valid.txt"

    @property
    def logs(self) -> Path:
        """Logs kept for a human (a failed training's worker stderr); no stage reads them."""
        return self.root / "data/logs"

    @property
    def eval_samples(self) -> Path:
        """Prompt / reference / generation rows written by the evaluate stage."""
        return self.root / "data/eval/samples.json"

    @property
    def model_version(self) -> Path:
        """The MLflow registry version the export stage created and its promotion decision."""
        return self.root / "data/lineage/model_version.json"

    @property
    def train_run(self) -> Path:
        """The MLflow run id of the last training. Kept out of data/trained so the trained
        weights folder is byte-identical when a training is reproduced."""
        return self.root / "data/lineage/train_run.json"


@dataclass(frozen=True)
class Workspace:
    """A validated config plus the project it runs in."""

    config: FinetuneConfig
    root: Path
    params_path: Path

    @classmethod
    def load(
        cls, params: str | Path = DEFAULT_PARAMS, overrides: dict[str, Any] | list[str] | None = None
    ) -> "Workspace":
        params_path = Path(params)
        if not params_path.is_absolute() and not params_path.exists():
            params_path = find_project_root() / params_path
        config = load_config(params_path, overrides)
        return cls(config=config, root=project_root_for(params_path), params_path=params_path)

    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    def resolve(self, path: str | Path) -> Path:
        """A path from the params file, relative to the project root."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.root / p

    def mlflow_uri(self) -> str:
        uri = self.config.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        return uri or f"sqlite:///{self.root / 'mlflow.db'}"


class WorkspaceBusy(PipelineError):
    """Another pipeline run holds the workspace lock."""


#: set while a process holds the lock ("<pid> <lock path>"): the commands it starts (dvc repro,
#: each stage's `finetune stage`) inherit it and run under their ancestor's lock
HOLDER_ENV = "FINETUNE_WORKSPACE_LOCK"


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:  # Linux: "pid (comm) state ppid ..."
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return psutil.Process(pid).ppid()
        except Exception:  # no such process, or no way to ask
            return None


def held_by_an_ancestor(path: Path) -> bool:
    """This process descends from a holder of the lock at `path` (`finetune run` -> dvc
    repro -> `finetune stage`), per HOLDER_ENV. The holder itself does not count: a second
    run in the same process (a flow called twice, in threads) must find the lock taken."""
    held = os.environ.get(HOLDER_ENV, "")
    pid_text, _, held_path = held.partition(" ")
    if not pid_text.isdigit() or held_path != str(path):
        return False
    holder, pid = int(pid_text), _parent_pid(os.getpid())
    for _ in range(64):  # the chain from us to the holder is short; a loop never ends here
        if pid is None or pid <= 1:
            return False
        if pid == holder:
            return True
        pid = _parent_pid(pid)
    return False


@contextlib.contextmanager
def workspace_lock(root: Path, wait_seconds: float = 0.0, poll: float = 1.0) -> Iterator[Path]:
    """An exclusive lock on a project: two runs never write one workspace at once.

    Every writer takes it: `finetune run`, the Prefect flow and each `finetune stage` command
    (so a bare `dvc repro`, which runs those, holds it stage by stage). A command started under
    a holder (HOLDER_ENV names a live ancestor and this lock) runs under that lock instead of
    taking it again. `flock` is released by the kernel when the holder dies, so a killed run
    never leaves a stale lock. The second run waits up to `wait_seconds`, then fails with who
    holds it.
    """
    import fcntl
    import time

    path = (root / ".finetune.lock").resolve()
    if held_by_an_ancestor(path):
        yield path
        return
    fh = open(path, "a+")
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                fh.close()
                raise WorkspaceBusy(
                    f"workspace {root} is busy: another pipeline run holds {path} ({holder}); "
                    "wait for it to finish"
                ) from None
            time.sleep(poll)
    before = os.environ.get(HOLDER_ENV)
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        fh.flush()
        os.environ[HOLDER_ENV] = f"{os.getpid()} {path}"
        yield path
    finally:
        if before is None:
            os.environ.pop(HOLDER_ENV, None)
        else:
            os.environ[HOLDER_ENV] = before
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def find_project_root(fallback: Path | None = None) -> Path:
    """FINETUNE_ROOT, else the cwd when it holds dvc.yaml, else `fallback` (the code's repo)."""
    if os.environ.get("FINETUNE_ROOT"):
        return Path(os.environ["FINETUNE_ROOT"]).resolve()
    cwd = Path.cwd()
    if (cwd / "dvc.yaml").exists() or fallback is None:
        return cwd.resolve()
    return fallback.resolve()
