"""A real one-host SLURM cluster for the tests, from Debian's `slurm-wlm` and `munge` packages.

munged with its own socket and key, then slurmctld and slurmd in the foreground with a minimal
slurm.conf: this host as one 2-CPU node in one partition, `proctrack/linuxproc` and
`task/none` (no cgroups needed), no accounting (job states from `scontrol show job`), free
ports, every file in a temporary folder. The daemons run as root, as on the CI machine. Client
commands find the cluster through `SLURM_CONF`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")
INSTALL = ("apt-get install slurm-wlm munge (as root; .ci/run installs them before "
           "`make test-slow`)")


def missing() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None
            and not Path("/usr/sbin", name).exists()]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
ClusterName=finetune-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmdSpoolDir={dir}/spool
StateSaveLocation={dir}/state
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
MinJobAge=3600
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def cluster(root: Path, cpus: int = 2):
    """Start the cluster under `root`; yields the environment its clients need."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("spool", "state", "munge"):
        (root / sub).mkdir(exist_ok=True)
    munge_dir = root / "munge"
    munge_dir.chmod(0o700)
    key = munge_dir / "munge.key"
    if Path("/etc/munge/munge.key").exists():
        shutil.copyfile("/etc/munge/munge.key", key)
    else:
        key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = munge_dir / "socket"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=host, ctld_port=_free_port(), slurmd_port=_free_port(),
                                munge_socket=sock, dir=root, cpus=cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    logs = open(root / "daemons.log", "ab")
    try:
        procs.append(subprocess.Popen(
            [_which("munged"), "--foreground", "--force", f"--socket={sock}",
             f"--key-file={key}", f"--log-file={munge_dir / 'munged.log'}",
             f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'seed'}"],
            stdout=logs, stderr=logs))
        _wait(lambda: sock.exists(), 20, "munged's socket", root)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([_which(daemon), "-D", "-f", str(conf)], env=env,
                                          stdout=logs, stderr=logs))
        _wait(lambda: _node_state(env) in ("idle", "idle~", "mixed", "allocated"), 60,
              "the node to come up idle", root)
        yield {"SLURM_CONF": str(conf)}
    finally:
        if procs:
            subprocess.run([_which("scancel"), "--full", "--user", "root"], env=env,
                           capture_output=True)
            time.sleep(1)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        logs.close()


def _node_state(env) -> str:
    proc = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True,
                          text=True)
    return proc.stdout.strip()


def _wait(ready, timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                              for p in sorted(root.glob("*.log")))
            raise RuntimeError(f"test SLURM cluster: no {what} after {timeout}s\n{tails}")
        time.sleep(0.3)


def job_state(job_id: str, env: dict) -> dict[str, str]:
    """`scontrol show job -o` as a dict (the test's own reading, not the product's parser)."""
    out = subprocess.run([_which("scontrol"), "show", "job", "-o", job_id],
                         env={**os.environ, **env}, capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def scontrol(*args: str, env: dict) -> None:
    subprocess.run([_which("scontrol"), *args], env={**os.environ, **env}, check=True,
                   capture_output=True)
