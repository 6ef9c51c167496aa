"""Run one DVC stage the way `dvc repro` would, for orchestrators (the Prefect flow).

Going through `dvc repro --single-item STAGE` (whose cmd is `finetune stage STAGE`, the stage
function) means a Prefect run and a hand-typed `dvc repro` share one cache and one `dvc.lock`:
a stage whose inputs did not change is skipped by DVC itself, and a stage that ran is recorded
as if `dvc repro` had run it. Overrides are applied to the params file for the run, saved as a
DVC experiment, and the workspace is put back exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from engine.process.lifetime import EXIT_WITH, child_dies_with_us
from finetune.config.loader import read_params_file, set_keys, validate_raw
from finetune.config.overrides import apply_overrides
from finetune.errors import PipelineError

RAN = re.compile(r"Running stage '([\w-]+)'")
#: DVC's line for a stage its run-cache restored instead of running it
RESTORED_BY_RUN_CACHE = re.compile(r"Stage '([\w-]+)' is cached - skipping run")
#: the run-specific record each stage writes outside DVC (this clone's MLflow run, registered
#: version): it describes the outputs that stage made here, not outputs DVC restored
LINEAGE_OF = {"train": ("data/lineage/train_run.json",),
              "export": ("data/lineage/model_version.json",)}
GIT_TRACKED_RESULTS = ("dvc.lock", "data/metrics", "data/plots")
#: what an override run puts back as it was: the git-tracked results, and the record of which
#: MLflow run and registered version the restored outputs belong to (gitignored)
RESTORED = (*GIT_TRACKED_RESULTS, "data/lineage")


class StageFailed(PipelineError):
    """A DVC stage failed; `stage_exit` is its command's exit code (2 bad input, 75 transient)."""

    def __init__(self, message: str, stage_exit: int | None):
        super().__init__(message)
        self.stage_exit = stage_exit

    @property
    def transient(self) -> bool:
        return self.stage_exit == 75


@dataclass
class StageResult:
    stage: str
    ran: bool
    output: str


def dvc_exe() -> list[str]:
    exe = Path(sys.executable).with_name("dvc")
    return [str(exe)] if exe.exists() else [shutil.which("dvc") or "dvc"]


def dvc_env() -> dict[str, str]:
    """The environment with this venv's bin first, so DVC finds the `finetune` command."""
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def stream(cmd: list[str], cwd: Path, on_line: Callable[[str], None] | None = None,
           env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `cmd`, passing each output line to `on_line` as it comes; return (rc, output).

    The command dies with this process however it dies (engine/process/lifetime.py; the stage under
    it is started with FINETUNE_EXIT_WITH=<our pid> and dies with us in turn), and SIGINT or
    SIGTERM sent to this process (Ctrl-C, an orchestrator's cancel) is passed on to the
    command's whole process group before this process stops."""
    env = {**(env or dvc_env()), EXIT_WITH: str(os.getpid())}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, preexec_fn=child_dies_with_us())
    lines = []
    assert proc.stdout is not None
    with forward_signals(proc):
        for line in proc.stdout:
            lines.append(line)
            if on_line:
                on_line(line.rstrip("\n"))
        return proc.wait(), "".join(lines)


@contextlib.contextmanager
def forward_signals(proc: subprocess.Popen):
    """While the block runs, SIGINT/SIGTERM to this process go to `proc`'s process group
    first, then take their usual course here. Signal handlers can only be set from the main
    thread; elsewhere the parent-death signal alone ends the command."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)  # the stage stops torchrun, which stops the workers
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stage_error(output: str) -> str | None:
    """The stage's own one-line `error: ...` (from the finetune CLI), if it printed one."""
    found = [ln[len("error: "):] for ln in output.splitlines() if ln.startswith("error: ")]
    return found[-1] if found else None


def repro_stage(root: Path, stage: str, on_line: Callable[[str], None] | None = None,
                extra_env: dict[str, str] | None = None) -> StageResult:
    env = {**dvc_env(), **(extra_env or {})}
    rc, out = stream(dvc_exe() + ["repro", "--single-item", stage], root, on_line, env)
    if rc != 0:
        dvc_error = next((ln for ln in out.splitlines() if ln.startswith("ERROR")), None)
        code = re.search(r"exited with (-?\d+)", dvc_error or "")
        raise StageFailed(
            f"stage '{stage}' failed: {stage_error(out) or dvc_error or f'dvc exited {rc}'}",
            int(code.group(1)) if code else None)
    return StageResult(stage, stage in RAN.findall(out), out)


def forget_lineage_of_restored(root: Path, output: str) -> list[str]:
    """After `dvc repro` output in which DVC's run-cache restored stages: the lineage records
    of those stages (LINEAGE_OF) removed, since no run in this clone made the restored
    outputs (a record left from an earlier run would name the wrong MLflow run). Returns the
    stages restored."""
    restored = RESTORED_BY_RUN_CACHE.findall(output)
    for stage in restored:
        for rel in LINEAGE_OF.get(stage, ()):
            (root / rel).unlink(missing_ok=True)
    return restored


def stage_outs(root: Path, stage: str) -> tuple[list[str], list[str]]:
    """dvc.yaml's outputs of `stage`: (cached ones, uncached ones kept in git)."""
    spec = yaml.safe_load((root / "dvc.yaml").read_text())["stages"].get(stage, {})
    cached, uncached = [], []
    for kind in ("outs", "metrics", "plots"):
        for entry in spec.get(kind, []):
            path, opts = next(iter(entry.items())) if isinstance(entry, dict) else (entry, {})
            (uncached if (opts or {}).get("cache") is False else cached).append(path)
    return cached, uncached


def out_of_sync_notice(root: Path, stage: str, overrides: list[str]) -> str | None:
    """After `finetune stage NAME` by hand: whether the workspace still matches dvc.lock, and
    if not, what the next `dvc repro` will do and how to get the recorded outputs back. None
    when DVC sees no change (the same params wrote the same bytes) or the project has no
    dvc.yaml stage of that name."""
    if not (root / "dvc.yaml").exists() or not (root / "dvc.lock").exists():
        return None
    cached, uncached = stage_outs(root, stage)
    if not cached and not uncached:
        return None
    proc = subprocess.run(dvc_exe() + ["status", "--quiet", stage], cwd=root, env=dvc_env(),
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    made = f" with {' '.join('-s ' + o for o in overrides)}" if overrides else ""
    back = [f"`dvc checkout --force {stage}` (the cached outputs {', '.join(cached)}, from "
            "DVC's cache; this run's are discarded)"] if cached else []
    if uncached:
        back.append(f"`git checkout -- {' '.join(uncached)}`")
    return (f"[{stage}] note: this run{made} wrote its outputs outside DVC, so the workspace now "
            f"differs from dvc.lock; the next `dvc repro` reruns {stage} and the stages after "
            f"it. To get back what dvc.lock records: {' and '.join(back)}.")


class OverrideSession:
    """Apply overrides to the params file for one run; restore everything afterwards.

    The merged params are validated before anything is written. On exit the run is saved as a
    DVC experiment (`dvc exp show` lists it), then the params file, dvc.lock, metrics and plots
    are restored byte for byte and `dvc checkout` puts the baseline outputs back.
    """

    def __init__(self, root: Path, params_file: Path, overrides: dict[str, Any] | list[str]):
        self.root, self.params_file, self.overrides = root, params_file, overrides
        self._backup: Path | None = None

    def __enter__(self) -> "OverrideSession":
        raw = read_params_file(self.params_file)
        if isinstance(self.overrides, dict):  # dotted keys to JSON values
            merged = set_keys(raw, self.overrides)
        else:  # `-s` strings, as dvc exp run -S applies them
            merged = apply_overrides(raw, self.overrides, str(self.params_file), self.params_file)
        validate_raw(merged, source=f"{self.params_file} with overrides")
        self._backup = Path(tempfile.mkdtemp(prefix="finetune-baseline-"))
        for rel in (str(self.params_file.relative_to(self.root)), *RESTORED):
            src = self.root / rel
            if src.is_dir():
                shutil.copytree(src, self._backup / rel)
            elif src.exists():
                (self._backup / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, self._backup / rel)
        self.params_file.write_text(yaml.safe_dump(merged, sort_keys=False))
        return self

    def save_experiment(self, name: str) -> str:
        untracked = [p for p in GIT_TRACKED_RESULTS if (self.root / p).exists()]
        cmd = dvc_exe() + ["exp", "save", "--force", "-n", name]
        for path in untracked:
            cmd += ["-I", path]
        proc = subprocess.run(cmd, cwd=self.root, env=dvc_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise PipelineError(f"dvc exp save failed: {(proc.stderr or proc.stdout).strip()}")
        return name

    def __exit__(self, *exc) -> None:
        assert self._backup is not None
        for rel in (str(self.params_file.relative_to(self.root)), *RESTORED):
            saved, live = self._backup / rel, self.root / rel
            if saved.is_dir():
                shutil.rmtree(live, ignore_errors=True)
                shutil.copytree(saved, live)
            elif saved.exists():
                shutil.copy2(saved, live)
            elif live.exists() and not live.is_dir():
                live.unlink()  # did not exist before the run
        shutil.rmtree(self._backup, ignore_errors=True)
        subprocess.run(dvc_exe() + ["checkout", "--force", "--quiet"], cwd=self.root, env=dvc_env(),
                       capture_output=True, text=True)
