"""Failures that are not the user's input, each one line naming the cause and what to do.

Real trials through `finetune stage train`: a full disk (a small tmpfs mounted over the
checkpoint folder in a private mount namespace), a rank killed by SIGKILL (what the kernel's
out-of-memory killer does), a rank that hangs past `distributed.ddp_timeout`, a rendezvous no
other node joins. Before this, the first gave "training failed: torchrun exited 1 (see log
above)" and a traceback, and the others torchrun's multi-screen failure dump.
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import BIN, error_line, run_cli, stage_outputs, train_here, write_params

DDP2 = {"distributed.strategy": "ddp", "distributed.nproc_per_node": 2}


def _tmpfs_usage(folder: Path) -> int:
    """Bytes `folder` takes on a tmpfs (whole 4 KiB pages per file and folder)."""
    pages = sum(math.ceil(p.stat().st_size / 4096) or 1 for p in folder.rglob("*"))
    return (pages + 1) * 4096


def _can_mount_privately() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def _in_own_mount_namespace(project, script: str):
    """Run `script` (which mounts a small tmpfs and ends with `echo "rc=$?" >&2`) in its own
    user and mount namespace; the stage's exit code must be 1; its one error line."""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c",
                           script], cwd=project, capture_output=True, text=True)
    rc_line = [ln for ln in proc.stderr.splitlines() if ln.startswith("rc=")]
    assert rc_line == ["rc=1"], proc.stderr
    stderr = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("rc="))
    line = error_line(subprocess.CompletedProcess([], 1, proc.stdout, stderr), code=1)
    return proc, line


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_what_was_written(
        tokenized, tmp_path):
    if not _can_mount_privately():
        pytest.skip("unprivileged mount namespaces are disabled on this machine")
    project, _ = train_here(tokenized, tmp_path / "p")  # checkpoints at 3 and 6, trained model
    checkpoints = project / "data/checkpoints"
    keep = tmp_path / "step-0000003"
    shutil.move(checkpoints / "step-0000003", keep)
    shutil.rmtree(checkpoints / "step-0000006")
    before = {k: v for k, v in stage_outputs(project).items() if "/plots/" not in k}
    write_params(project, {"checkpoint.resume_from_checkpoint": True})
    # room for the step-3 checkpoint and half another: resuming, the step-6 save fills it
    size = _tmpfs_usage(keep) * 3 // 2
    script = (
        f"mount -t tmpfs -o size={size} tmpfs data/checkpoints && "
        f"cp -a {keep} data/checkpoints/ && "
        f"{BIN / 'finetune'} stage train; echo \"rc=$?\" >&2; "
        f"{BIN / 'python'} -c \"from pathlib import Path; from engine.state import checkpoint as c; "
        f"print('latest', c.latest(Path('data/checkpoints')).name); "
        f"print('entries', sorted(p.name for p in Path('data/checkpoints').iterdir()))\"")
    proc, line = _in_own_mount_namespace(project, script)
    assert line.startswith("error: disk full writing ") and "data/checkpoints" in line, line
    assert "checkpoint.save_total_limit" in line and "intact" in line, line
    # the step-3 checkpoint is still the valid latest, and the half-written one is gone
    assert "latest step-0000003" in proc.stdout and "entries ['step-0000003']" in proc.stdout
    assert {k: v for k, v in stage_outputs(project).items()
            if "/plots/" not in k and "/checkpoints/" not in k} == {
        k: v for k, v in before.items() if "/checkpoints/" not in k}
    assert "[rank 0] error: disk full" in (project / "data/logs/train-failure.log").read_text()


def _workers(stage: subprocess.Popen) -> dict[int, psutil.Process]:
    """The torchrun workers of a running stage, by RANK."""
    found = {}
    for proc in psutil.Process(stage.pid).children(recursive=True):
        try:
            if "engine.worker" in proc.cmdline():
                found[int(proc.environ()["RANK"])] = proc
        except (psutil.NoSuchProcess, KeyError):
            continue
    return found


def _start_stage(project: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(stage: subprocess.Popen, prefix: str) -> None:
    for line in stage.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the stage ended before printing {prefix!r}: {stage.stderr.read()}")


def _finish(stage: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = stage.communicate(timeout=120)
    return subprocess.CompletedProcess(stage.args, stage.returncode, out, err)


@pytest.mark.distributed
def test_a_rank_killed_by_sigkill_is_named_with_the_oom_killer(tokenized, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, DDP2)
    stage = _start_stage(project)
    _wait_for_line(stage, "[train] step=2 ")
    _workers(stage)[1].kill()
    line = error_line(_finish(stage), code=1)
    assert "rank 1 was killed by SIGKILL" in line and "out-of-memory killer" in line, line
    assert "resume_from_checkpoint: true" in line, line
    assert not (project / "data/trained").exists()
    assert "Root Cause" in (project / "data/logs/train-failure.log").read_text()


@pytest.mark.distributed
def test_a_hung_rank_times_out_after_ddp_timeout_in_one_line(tokenized, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, {**DDP2, "distributed.ddp_timeout": 5})
    stage = _start_stage(project)
    _wait_for_line(stage, "[train] step=2 ")
    workers = _workers(stage)
    workers[1].suspend()  # SIGSTOP: alive, silent, like a rank stuck in a driver call
    try:
        workers[0].wait(timeout=60)  # rank 0 gives up after the timeout
    finally:
        workers[1].resume()  # so it can take torchrun's SIGTERM
    proc = _finish(stage)
    line = error_line(proc, code=75)  # transient: an orchestrator may retry it
    assert "rank 0 timed out after distributed.ddp_timeout 5 s" in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_rendezvous_nobody_joins_is_one_line(tokenized, tmp_path, node_rank):
    """node 0 waits for a node that never comes; node 1 finds nobody at the endpoint."""
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, {"distributed.strategy": "ddp", "distributed.nnodes": 2,
                           "distributed.node_rank": node_rank, "distributed.rdzv_timeout": 5,
                           "distributed.rdzv_endpoint": f"127.0.0.1:{_free_port()}"})
    started = time.monotonic()
    line = error_line(run_cli(project, "stage", "train"), code=75)
    assert "the rendezvous at 127.0.0.1:" in line and "rdzv_id finetune" in line, line
    assert "nothing was written" in line and time.monotonic() - started < 90
    assert not (project / "data/trained").exists()


def test_out_of_memory_and_disk_full_errors_are_described_by_cause():
    """The worker's classification of real exceptions: a CPU allocation torch refuses, a
    write to /dev/full (ENOSPC from the kernel), CUDA's OutOfMemoryError type."""
    import torch

    from engine.process.failures import describe

    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        cpu = describe(exc, rank=3)
    assert cpu.kind == "memory" and cpu.message.startswith("out of CPU memory"), cpu
    assert "on rank 3" in cpu.message and "per_device_train_batch_size" in cpu.message
    try:
        with open("/dev/full", "w") as fh:
            fh.write("x")
    except OSError as exc:
        full = describe(exc, rank=0)
    assert full.kind == "disk" and full.message.startswith("disk full (rank 0): "), full
    cuda = describe(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1)
    assert cuda.kind == "memory" and cuda.message.startswith("CUDA out of memory"), cuda
    assert describe(ValueError("boom"), 0).message == "training crashed on rank 0: ValueError: boom"


def test_a_full_disk_is_named_by_the_folder_even_after_another_rank_freed_space(tmp_path):
    """Under DDP a rank may look at the free space only after the leader removed its
    half-written save (seen in a fresh-clone run: 'disk full (rank 1): free space on that
    filesystem', no path). An error that itself says ENOSPC without naming a file is taken
    for a full disk whatever the free space now, and named by the folder being written."""
    import errno
    import os

    from engine.process.failures import describe
    from finetune.files import discard_on_failure

    class CheckpointException(BaseException):  # DCP's wrapper: per-rank (error, traceback)
        def __init__(self, msg, failures):
            super().__init__(msg)
            self.failures = failures

    staging = tmp_path / "checkpoints" / ".step-0000003.tmp"
    staging.mkdir(parents=True)
    write_failed = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # file.write(): no name
    with pytest.raises(OSError) as caught:
        with discard_on_failure(staging, remove=False):
            raise CheckpointException("ranks:dict_keys([0, 1])", {1: (write_failed, None)})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(staging)
    report = describe(caught.value, rank=1)
    assert report.kind == "disk" and report.message.startswith(
        f"disk full writing {staging} (rank 1): free space"), report
    with pytest.raises(ValueError):  # plenty of space and no word of a full disk: as raised
        with discard_on_failure(staging, remove=False):
            raise ValueError("boom")


def test_a_refused_write_names_the_folder_and_the_fix(tmp_path):
    """A read-only filesystem (or a folder this user may not write) under a checkpoint or
    output write: DCP names only its own file ('__0_0.distcp'); the report names the folder
    being written and what to do, in one line."""
    import errno

    from engine.process.failures import describe
    from finetune.files import discard_on_failure

    folder = tmp_path / "checkpoints"
    staging = folder / ".step-0000003.tmp"
    staging.mkdir(parents=True)
    with pytest.raises(OSError) as caught:
        with discard_on_failure(staging):
            raise OSError(errno.EROFS, "Read-only file system", "__0_0.distcp")
    assert not staging.exists() and caught.value.filename == str(folder)
    report = describe(caught.value, rank=0)
    assert report.kind == "disk" and report.message.startswith(
        f"cannot write {folder} (rank 0): Read-only file system; make that folder writable"), report
    assert "checkpoint.resume_from_checkpoint: true" in report.message


@pytest.mark.distributed
def test_disk_full_under_ddp_names_the_full_disk_not_dcps_wrapper(tokenized, tmp_path):
    """Two gloo ranks fill a tiny checkpoint filesystem at their first save. DCP raises its
    CheckpointException on every rank, carrying each rank's own error; the line used to be
    'training crashed on rank 1: CheckpointException ... ranks dict_keys([0, 1])'. It says
    what the single-process run says: the disk is full, where, and what to do."""
    if not _can_mount_privately():
        pytest.skip("unprivileged mount namespaces are disabled on this machine")
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    # a rank-256 adapter: a ~13 MB checkpoint (weights and Adam's moments) on an 8 MB disk,
    # so the space rank 0 frees when it drops its half-written save is more than the
    # nearly-full margin (finetune.files.NEARLY_FULL) by the time rank 1 looks
    write_params(project, {**DDP2, "peft.r": 256})
    before = stage_outputs(project)
    script = (f"mkdir -p data/checkpoints && mount -t tmpfs -o size=8m tmpfs data/checkpoints"
              f" && {BIN / 'finetune'} stage train; echo \"rc=$?\" >&2")
    _, line = _in_own_mount_namespace(project, script)
    assert line.startswith("error: disk full writing ") and "data/checkpoints" in line, line
    assert "CheckpointException" not in line and "checkpoint.save_total_limit" in line, line
    assert {k: v for k, v in stage_outputs(project).items() if "/plots/" not in k} == {
        k: v for k, v in before.items() if "/plots/" not in k}


#: torchrun's failure summary when rank 1 exited first (the shape tasks/launch_failure reads)
RANK_1_FIRST = """Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 3598)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 3599)
"""


def test_a_ranks_share_of_a_failed_checkpoint_save_gives_way_to_the_full_disk(tmp_path):
    """The race behind 'training crashed on rank 1: CheckpointException ... ranks
    dict_keys([0, 1])': DCP raises its CheckpointException on every rank, carrying each
    rank's own error (torch's writer says 'unexpected pos', not ENOSPC); rank 0 finds its
    disk full, then drops its half-written save, so rank 1, looking a moment later, finds
    room, and torchrun saw rank 1 exit first. A real CheckpointException from a save into a
    1 MB filesystem: rank 1's report names the rank's own error, and the launcher's one line
    is rank 0's full disk with its path."""
    import errno
    import os
    import pickle
    import sys

    from engine.process.failures import describe
    from finetune.config.distributed import DistributedConfig
    from tasks.launch_failure import explain

    if not _can_mount_privately():
        pytest.skip("unprivileged mount namespaces are disabled on this machine")
    save = ("import pickle, sys, torch, torch.distributed.checkpoint as dcp, warnings\n"
            "warnings.filterwarnings('ignore')\n"
            "try:\n"
            "    dcp.save({'w': torch.randn(1_000_000)}, checkpoint_id='/mnt/step')\n"
            "except BaseException as exc:\n"
            "    sys.stdout.buffer.write(pickle.dumps(exc))\n")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c",
                           f"mount -t tmpfs -o size=1m tmpfs /mnt && {sys.executable} -c "
                           f"\"{save}\""], capture_output=True)
    assert proc.stdout, proc.stderr.decode()
    raised = pickle.loads(proc.stdout)
    assert type(raised).__name__ == "CheckpointException", raised
    rank1 = describe(raised, rank=1)
    assert rank1.kind == "checkpoint", rank1
    assert rank1.message.startswith("training crashed on rank 1 in a checkpoint save that "
                                    "failed on ranks 0: RuntimeError: "), rank1
    staging = tmp_path / "data/checkpoints/.step-0000003.tmp"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staging))  # finetune.files
    full.__cause__ = raised  # .as_disk_full on rank 0, before it removed its staging folder
    rank0 = describe(full, rank=0)
    error = explain([rank1, rank0], RANK_1_FIRST, DistributedConfig(), tmp_path / "log")
    assert str(error).startswith(f"disk full writing {staging} (rank 0): free space"), error
    # the per-rank error is what is read, whichever rank it was
    wrapped = type(raised)("CheckpointException ranks:dict_keys([0, 1])", {
        0: (OSError(errno.ENOSPC, "No space left on device"), None), 1: raised.failures[0]})
    assert describe(wrapped, rank=1).kind == "disk"
