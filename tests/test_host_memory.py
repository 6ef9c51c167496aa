"""training.cpu_malloc_reuse: the train stage's workers keep freed memory for reuse.

The lever's speed is measured in bench/peers_cpu.py (never in a timed test). Here: the
settings reach the workers' environment (local torchrun and the SLURM script), they are off
when asked, and glibc really honours them: a round of large tensors allocated and freed in a
process with them faults in no new pages once the heap has settled, while with glibc's
defaults every round faults all of them in again. Page faults are counted by the kernel, so
this does not depend on timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from finetune.config import load_config
from finetune.host_memory import MALLOC_REUSE_ENV, worker_env
from finetune.workspace import Workspace

#: a training step's pattern: the same large tensors allocated and freed over and over; the
#: minor page faults of the last of ten rounds (glibc's heap settles within a few rounds:
#: posix_memalign's chunks do not fit the freed ones at once)
LAST_ROUND_FAULTS = """
import json, resource
import torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    before = faults()
    x = torch.ones(32 * 2**20); y = torch.ones(8 * 2**20); del x; z = torch.ones(20 * 2**20)
    del y, z
print(json.dumps({"faults": faults() - before, "pages": (32 + 8 + 20) * 2**20 * 4 // 4096}))
"""


def _workspace(tmp_path, overrides=None, params="default.yaml"):
    cfg = load_config(ROOT / "params" / params, overrides)
    return Workspace(config=cfg, root=tmp_path, params_path=tmp_path / "params/default.yaml")


def test_workers_get_the_malloc_settings_unless_turned_off(tmp_path):
    from tasks.launch import worker_environment
    from tasks.slurm.script import render

    on, off = _workspace(tmp_path), _workspace(tmp_path, {"training.cpu_malloc_reuse": False})
    assert on.config.training.cpu_malloc_reuse  # the default
    env = worker_environment(on)
    assert {k: env[k] for k in MALLOC_REUSE_ENV} == MALLOC_REUSE_ENV
    assert worker_env(off.config) == {}
    inherited = {k: v for k, v in os.environ.items() if k in MALLOC_REUSE_ENV}
    assert {k: v for k, v in worker_environment(off).items() if k in MALLOC_REUSE_ENV} == inherited
    slurm = _workspace(tmp_path, params="slurm-ddp.yaml")
    script = render(slurm, tmp_path / "run")
    for key, value in MALLOC_REUSE_ENV.items():
        assert f"export {key}={value}" in script
    slurm_off = _workspace(tmp_path, {"training.cpu_malloc_reuse": False}, "slurm-ddp.yaml")
    assert "MALLOC_MMAP_MAX_" not in render(slurm_off, tmp_path / "run")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_glibc_reuses_freed_memory_with_the_settings_and_not_without():
    def last_round(extra: dict) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", LAST_ROUND_FAULTS],
                             env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    default, reuse = last_round({}), last_round(MALLOC_REUSE_ENV)
    assert default["faults"] > default["pages"] // 2  # glibc returned it; faulted in again
    assert reuse["faults"] < reuse["pages"] // 20  # kept in the heap and reused
