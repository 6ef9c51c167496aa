"""DDP, FSDP2 and DiLoCo under real torchrun (2 processes, gloo): parity, bytes, resume, nodes.

Every run goes through the train stage (`finetune stage train`), i.e. torchrun -> engine.worker.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    adapter,
    assert_weights_close,
    cut_back,
    interrupt_then_resume,
    losses,
    resume_cut_back,
    rows_seen,
    stage_outputs,
    stages_here,
    train_copy_here,
    train_here,
    train_in_place,
    train_metrics,
    train_stage_here,
    write_params,
)

#: every run here has two or more processes: `make test-slow` runs them
pytestmark = pytest.mark.distributed

TWO = {"distributed.nproc_per_node": 2}
# SGD without clipping: the DiLoCo H=1 identity is exact only when nothing is nonlinear in the
# gradient (clipping by the local vs the global norm would differ). Checkpoints every 3 steps:
# every reference run below is also the uninterrupted run a SIGKILL + resume must reproduce.
SGD = {"optimizer.name": "SGD", "optimizer.learning_rate": 0.05, "training.max_grad_norm": 1e9,
       "training.max_steps": 6, "eval.eval_steps": 3, "checkpoint.save_steps": 3,
       "checkpoint.save_total_limit": 10}
OUTER_SGD = {"distributed.strategy": "diloco", "distributed.diloco.outer_lr": 1.0,
             "distributed.diloco.outer_momentum": 0.0}
H3 = {**SGD, **TWO, **OUTER_SGD, "distributed.diloco.inner_steps": 3,
      "distributed.diloco.diloco_loops": 2}


@pytest.fixture(scope="module")
def ddp_run(tokenized, tmp_path_factory):
    """The reference: DDP, 2 ranks x batch 4, SGD, 6 steps."""
    project, proc = train_copy_here(tokenized, tmp_path_factory.mktemp("ddp") / "p",
                               {**SGD, **TWO, "distributed.strategy": "ddp"})
    return project


@pytest.fixture(scope="module")
def diloco_run(tokenized, tmp_path_factory):
    """DiLoCo, 2 workers x batch 4, H=3, 2 outer loops of outer SGD(lr 1) = model averaging."""
    project, proc = train_copy_here(tokenized, tmp_path_factory.mktemp("diloco") / "p", H3)
    assert "outer_step=2" in proc.stdout
    return project


@pytest.fixture(scope="module")
def single_run(tokenized, tmp_path_factory):
    """One process x batch 8: the examples of DDP 2 x 4 per step; with the rows each step read."""
    with rows_seen() as rows:
        project, _ = train_here(tokenized, tmp_path_factory.mktemp("single") / "p", {
            **SGD, "training.per_device_train_batch_size": 8})
    return project, rows


def resumes_on_another_world_size(full, reference, cut: Path, overrides: dict,
                                  rows: dict | None = None) -> None:
    """`full` cut back to its step-3 checkpoint and resumed with `overrides` (another number
    of processes, the same global batch) ends as `reference` did: losses within 1e-5 (fp32
    SGD; only the reduction order differs) and, in this process, the same rows per step."""
    cut_back(full, cut, 3, overrides)
    if overrides.get("distributed.nproc_per_node", 1) > 1:
        out = train_stage_here(cut).stdout
    else:
        with rows_seen() as seen:
            out = train_in_place(cut).stdout
        assert seen == {step: rows[step] for step in (3, 4, 5)}
    assert "step-0000003 at step 3" in out, out
    assert train_metrics(cut)["world_size"] == overrides.get("distributed.nproc_per_node", 1)
    assert losses(cut) == pytest.approx(losses(reference), abs=1e-5)
    assert_weights_close(adapter(cut), adapter(reference))


def export_loads(project) -> None:
    """LoRA trained under a strategy exports to a merged HF folder that loads and runs (the
    export stage's function in this process: no process boundary is under test here)."""
    from transformers import AutoModelForCausalLM

    stages_here(project, "export")
    model = AutoModelForCausalLM.from_pretrained(project / "data/export")
    assert not any("lora" in name for name, _ in model.named_parameters())
    out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


def refuses_another_world_size(project, world: int, overrides: dict) -> None:
    """DiLoCo keeps per-worker state that is not resharded: another world size is refused
    before any training step, with every checkpoint and curve left as it was. In this
    process, with the job the train stage hands torchrun (the CLI's one-line contract for
    such refusals: tests/test_reliability.py)."""
    from finetune.errors import PipelineError

    write_params(project, {**overrides, "checkpoint.resume_from_checkpoint": True})
    before = stage_outputs(project)
    with pytest.raises(PipelineError, match=f"world size {world} but this run"):
        train_in_place(project)
    assert stage_outputs(project) == before


def test_ddp_two_ranks_match_one_rank_with_double_batch(ddp_run, single_run):
    single, _ = single_run
    assert train_metrics(ddp_run)["world_size"] == 2 and train_metrics(single)["world_size"] == 1
    assert losses(ddp_run) == pytest.approx(losses(single), abs=1e-5)
    assert_weights_close(adapter(single), adapter(ddp_run))


def test_ddp_counts_exactly_its_gradient_bytes(ddp_run):
    m = train_metrics(ddp_run)
    trainable = m["trainable_params"]
    # per step: one fp32 gradient all-reduce of every trainable parameter, plus the float64
    # target-token count that makes the loss token-weighted across ranks
    assert m["comm_bytes_ddp_grad_all_reduce"] == 6 * trainable * 4
    assert m["comm_bytes_per_step"] == trainable * 4 + 8
    export_loads(ddp_run)


def test_fsdp2_with_accumulation_matches_ddp_and_resumes_after_sigkill(tokenized, ddp_run,
                                                                      single_run, tmp_path):
    """FSDP2, 2 ranks x batch 2 x accumulation 2 (reduce-scatter skipped on the first micro-batch)
    sees the same examples per step as DDP 2 x 4: equal losses in fp32. Killed after its first
    (sharded) checkpoint, it resumes bitwise; resharded, on one process too. It builds the
    model on meta: sharded before any weight exists, each rank reads only its shard of every
    stored tensor."""
    params = {**SGD, **TWO, "distributed.strategy": "fsdp2",
              "distributed.fsdp.reshard_after_forward": True,
              "training.per_device_train_batch_size": 2, "training.gradient_accumulation_steps": 2,
              "training.construct_model_on": "meta"}
    project, proc = train_copy_here(tokenized, tmp_path / "f", params)
    assert "strategy fsdp2, world size 2" in proc.stdout
    stored = (project / "data/models/stories260K/model.safetensors").stat().st_size
    read = train_metrics(project)["construct_bytes_read"]
    assert 0.4 * stored < read < 0.6 * stored  # rank 0's half of each tensor's rows
    assert losses(project) == pytest.approx(losses(ddp_run), abs=1e-5)
    assert_weights_close(adapter(project), adapter(ddp_run))
    m = train_metrics(project)
    assert m["comm_bytes_fsdp_all_gather"] > 0 and m["comm_bytes_fsdp_reduce_scatter"] > 0
    _, cut, stdout = interrupt_then_resume(tokenized, tmp_path, params, full=project)
    assert "at step 3" in stdout
    export_loads(project)
    # the sharded checkpoint resumes on one process (accumulation 4 keeps the global batch)
    resumes_on_another_world_size(project, ddp_run, tmp_path / "one", {
        "distributed.nproc_per_node": 1, "training.gradient_accumulation_steps": 4},
        single_run[1])


def test_ddp_checkpoint_resumes_on_one_process_and_one_process_on_two(
        ddp_run, single_run, tmp_path):
    """DDP 2 x 4 cut back to step 3 resumes on one process (batch 4 x accumulation 2); one
    process x 8 resumes on two (batch 4 each): each ends as the uninterrupted run."""
    single, rows = single_run
    resumes_on_another_world_size(ddp_run, ddp_run, tmp_path / "one", {
        "distributed.nproc_per_node": 1, "training.gradient_accumulation_steps": 2}, rows)
    resumes_on_another_world_size(single, single, tmp_path / "two", {
        **TWO, "distributed.strategy": "ddp", "training.per_device_train_batch_size": 4})


def test_another_global_batch_is_refused_naming_the_keys(ddp_run, tmp_path):
    """Two processes x 4 cannot continue on one process x 4 (4 examples a step, not 8): one
    line naming both splits and the key that restores it, before anything is written."""
    from finetune.errors import PipelineError

    cut = cut_back(ddp_run, tmp_path / "cut", 3, {"distributed.nproc_per_node": 1})
    before = stage_outputs(cut)
    with pytest.raises(PipelineError) as refused:
        train_in_place(cut)
    line = str(refused.value)
    assert line.startswith("checkpoint ") and "\n" not in line, line
    assert line.split("step-0000003 ", 1)[1] == (
        "has global batch 8 "
        "(per_device_train_batch_size 4 x gradient_accumulation_steps 1 x world size 2); this "
        "run's is 4 (per_device_train_batch_size 4 x gradient_accumulation_steps 1 x world "
        "size 1): set training.gradient_accumulation_steps 2 to resume")
    assert stage_outputs(cut) == before


def test_diloco_h1_with_sgd_is_ddp_sends_1_over_h_bytes_and_post_local_sgd(
        tokenized, ddp_run, diloco_run, tmp_path):
    h1, _ = train_copy_here(tokenized, tmp_path / "h1", {
        **H3, "distributed.diloco.inner_steps": 1, "distributed.diloco.diloco_loops": 6})
    assert losses(h1) == pytest.approx(losses(ddp_run), abs=1e-5)
    assert_weights_close(adapter(h1), adapter(ddp_run))
    per_step = {name: train_metrics(p)["comm_bytes_per_step"] for name, p in
                (("ddp", ddp_run), ("h1", h1), ("h3", diloco_run))}
    assert per_step["h1"] == per_step["ddp"]
    assert per_step["h3"] * 3 == per_step["ddp"]
    export_loads(diloco_run)
    # post-local SGD: DDP-style gradient averaging for 3 steps, then 3 local steps + averaging
    post, proc = train_copy_here(tokenized, tmp_path / "post", {
        **H3, "distributed.diloco.local_sgd_start_step": 3})
    assert losses(post)[:3] == pytest.approx(losses(ddp_run)[:3], abs=1e-5)
    assert losses(post)[3:] != pytest.approx(losses(ddp_run)[3:], abs=1e-5)
    m, trainable = train_metrics(post), train_metrics(post)["trainable_params"]
    assert m["comm_bytes_grad_all_reduce"] == 3 * trainable * 4
    assert m["comm_bytes_diloco_pseudo_grad"] == 1 * trainable * 4
    assert "outer_step=1" in proc.stdout and "outer_step=2" not in proc.stdout


def test_post_local_gradient_allreduce_on_one_node_is_ddp(tokenized, ddp_run, diloco_run,
                                                          tmp_path):
    """Hierarchical post-local SGD averages gradients within each node every step; on one node
    that is every rank, so local steps + model averaging train exactly as DDP does (and the
    plain local run, which ignores the key, does not)."""
    params = {**H3, "distributed.diloco.post_local_gradient_allreduce": True}
    project, proc = train_copy_here(tokenized, tmp_path / "hier", params)
    assert losses(project) == pytest.approx(losses(ddp_run), abs=1e-5)
    assert_weights_close(adapter(project), adapter(ddp_run))
    assert losses(diloco_run)[1:] != pytest.approx(losses(ddp_run)[1:], abs=1e-5)
    m, trainable = train_metrics(project), train_metrics(project)["trainable_params"]
    assert m["comm_bytes_post_local_grad_all_reduce"] == 6 * trainable * 4
    assert m["comm_bytes_diloco_pseudo_grad"] == 2 * trainable * 4


def test_diloco_resumes_after_sigkill(tokenized, diloco_run, tmp_path):
    """Killed after the first outer loop's checkpoint, DiLoCo resumes bitwise (inner and
    outer optimizer state, the global copy)."""
    _, cut, stdout = interrupt_then_resume(tokenized, tmp_path, H3, full=diloco_run)
    assert "at step 3" in stdout
    refuses_another_world_size(cut, 2, {"distributed.nproc_per_node": 1})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(nodes: list, params: dict, node1_first: bool = False) -> list[str]:
    """Both nodes' train stages (c10d rendezvous on a fresh loopback port); their stdout.
    `node1_first`: node 1's stage starts seconds before node 0's, so its torchrun agent has
    the lower pid and c10d (which sorts a loopback's agents by pid, ignoring --node_rank)
    gives node 1 global rank 0."""
    import time

    port = _free_port()
    for rank, node in enumerate(nodes):
        write_params(node, {**params, "distributed.nproc_per_node": 1, "distributed.nnodes": 2,
                            "distributed.node_rank": rank,
                            "distributed.rdzv_endpoint": f"127.0.0.1:{port}",
                            "distributed.rdzv_id": f"test-{port}"})
    procs = {}
    for node in (reversed(nodes) if node1_first else nodes):
        procs[node] = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=node,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if node1_first:
            time.sleep(4)
    procs = [procs[node] for node in nodes]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    return [out for out, _ in outs]


def test_two_nodes_on_loopback_match_single_node_ddp(ddp_run, tmp_path):
    """Two torchrun launches (--nnodes 2, c10d rendezvous on 127.0.0.1), one process each,
    each in its own project folder (no shared storage): the same training as one node with 2
    processes. With save_on_each_node each node keeps whole checkpoints of its own, and both
    resume from them bitwise."""
    from engine.state.checkpoint import is_valid

    nodes = []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        shutil.copytree(ddp_run, node, symlinks=True)
        for out in ("data/trained", "data/plots", "data/metrics/train.json", "data/checkpoints"):
            path = node / out
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        nodes.append(node)
    outs = _run_two_nodes(nodes, {"checkpoint.save_on_each_node": True})
    assert "world size 2" in outs[0] and "node 1 finished" in outs[1]
    assert not (nodes[1] / "data/trained").exists()
    assert losses(nodes[0]) == pytest.approx(losses(ddp_run), abs=1e-5)
    assert train_metrics(nodes[0])["world_size"] == 2
    # log_on_each_node (HF's default): node 1 prints the same rows under its own prefix
    node1_rows = [line for line in outs[1].splitlines() if line.startswith("[train node 1]")]
    main_rows = [line for line in outs[0].splitlines()
                 if line.startswith("[train] step=") and " loss=" in line]
    assert len(main_rows) > 1 and [r.split()[3:5] for r in node1_rows] == [
        r.split()[1:3] for r in main_rows], outs[1]  # step=N loss=...
    # save_on_each_node: a whole, valid copy on each node; cut both back to step 3, resume
    for node in nodes:
        assert [is_valid(node / f"data/checkpoints/step-000000{s}") for s in (3, 6)] == [True] * 2
    uninterrupted, curve = adapter(nodes[0]), losses(nodes[0])
    for node in nodes:
        shutil.rmtree(node / "data/checkpoints/step-0000006")
    shutil.rmtree(nodes[0] / "data/trained")
    (nodes[0] / "data/plots/train.csv").unlink()
    # the restart's rendezvous may order the nodes otherwise (c10d sorts its agents, not by
    # --node_rank): node 1 holds global rank 0 now, and still resumes from its own copy
    outs = _run_two_nodes(nodes, {"checkpoint.resume_from_checkpoint": True}, node1_first=True)
    assert "step-0000003 at step 3" in outs[0]
    resumed = adapter(nodes[0])
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    assert losses(nodes[0]) == curve


def test_diloco_workers_sharded_with_fsdp2_match_unsharded_workers(tokenized, diloco_run,
                                                                    tmp_path):
    """OpenDiLoCo's layout: 4 processes = 2 DiLoCo workers x FSDP2 groups of 2 (batch 2 each)
    trains like 2 unsharded workers with batch 4 (the same examples per worker and step); each
    rank then sends only its shard of the pseudo-gradient. Resumed through the stage from the
    first outer loop's checkpoint (each worker's sharded inner optimizer state), the sharded
    workers end bitwise where the uninterrupted run did (the SIGKILL itself: the two tests
    above)."""
    params = {**H3, "distributed.nproc_per_node": 4, "training.per_device_train_batch_size": 2,
              "distributed.diloco.fsdp_group_size": 2}
    sharded, proc = train_copy_here(tokenized, tmp_path / "sharded", params)
    assert "strategy diloco, world size 4" in proc.stdout
    assert losses(sharded) == pytest.approx(losses(diloco_run), abs=1e-5)
    assert_weights_close(adapter(sharded), adapter(diloco_run))
    m, p = train_metrics(sharded), train_metrics(diloco_run)
    assert 0 < m["comm_bytes_diloco_pseudo_grad"] < p["comm_bytes_diloco_pseudo_grad"]
    assert m["comm_bytes_fsdp_all_gather"] > 0
    resume_cut_back(sharded, tmp_path, at=3)
    refuses_another_world_size(tmp_path / "cut", 4, {"distributed.nproc_per_node": 1,
                                        "distributed.diloco.fsdp_group_size": 1})
