"""Pipeline parallelism (`distributed.strategy: pipeline`) under real torchrun, 2 processes on
gloo: the stages' training equals single-process training on the same batches, a SIGKILLed
run resumes bitwise from its per-stage DCP checkpoint, and the export is one normal folder.

Its own file so it runs beside test_strategies.py (pytest-xdist, one file per worker)."""

from __future__ import annotations

import pytest
from helpers import (
    adapter,
    assert_weights_close,
    interrupt_then_resume,
    losses,
    train_copy,
    train_here,
    train_metrics,
)

from finetune.config.schema import FinetuneConfig

# 10 steps of batch 4 (2 pipeline micro-batches of 2), an in-training eval and a checkpoint
# at step 5: the reference single-process run sees exactly the same batches
BASE = {"training.max_steps": 10, "training.per_device_train_batch_size": 4,
        "training.per_device_eval_batch_size": 4, "eval.eval_steps": 5,
        "checkpoint.save_steps": 5, "checkpoint.save_total_limit": 10,
        "logging.logging_steps": 1}
PIPE = {**BASE, "distributed.strategy": "pipeline", "distributed.nproc_per_node": 2}


@pytest.fixture(scope="module")
def single(tokenized, tmp_path_factory):
    project, _ = train_here(tokenized, tmp_path_factory.mktemp("single") / "p", BASE)
    return project


@pytest.fixture(scope="module")
def single_double_batch(tokenized, tmp_path_factory):
    """The reference for 2 pipeline replicas of batch 4: one process with batch 8."""
    project, _ = train_here(tokenized, tmp_path_factory.mktemp("single8") / "p", {
        **BASE, "training.per_device_train_batch_size": 8})
    return project


@pytest.fixture(scope="module")
def one_f_one_b(tokenized, tmp_path_factory):
    """The 1F1B run: compared with one process below, and the uninterrupted run the SIGKILL
    test's resume must reproduce."""
    return train_copy(tokenized, tmp_path_factory.mktemp("1f1b") / "p", {
        **PIPE, "distributed.pipeline.schedule": "1F1B"})


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBVZeroBubble"])
def test_pipeline_trains_like_one_process(tokenized, single, single_double_batch, one_f_one_b,
                                          tmp_path, schedule):
    """1F1B: one stage per rank; ZBVZeroBubble: 2 stages per rank in a V, the zero-bubble split
    backward. GPipe runs pipeline x data parallel on 4 processes (2 replicas of a 2-stage
    pipeline, batch 4 each = one process with batch 8) and builds its model on meta: each rank
    reads only its stage's tensors from the checkpoint."""
    extra = {"training.construct_model_on": "meta", "distributed.nproc_per_node": 4,
             "distributed.pipeline.data_parallel_size": 2} if schedule == "GPipe" else {}
    run, proc = one_f_one_b if schedule == "1F1B" else train_copy(
        tokenized, tmp_path / "pp", {**PIPE, "distributed.pipeline.schedule": schedule, **extra})
    reference = single_double_batch if extra else single
    stages = 2 if schedule in ("GPipe", "1F1B") else 4  # multi-stage: 2 per rank
    assert f"pipeline {schedule}: {stages} stages" in proc.stdout
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
    if stages == 2:
        assert_weights_close(adapter(run), adapter(reference))
    else:  # 4 micro-batches of 1 row sum the gradient in another order: Adam's 1/sqrt(v)
        # amplifies that noise over 10 steps to ~3e-4 here; the losses above are the check
        assert adapter(run).keys() == adapter(reference).keys()
    m = train_metrics(run)
    assert m["strategy"] == "pipeline" and m["comm_bytes_pp_activations"] > 0
    assert m["num_input_tokens_seen"] == train_metrics(reference)["num_input_tokens_seen"]
    if extra:
        from safetensors import safe_open

        assert "2 data-parallel replicas" in proc.stdout and m["world_size"] == 4
        assert m["comm_bytes_pp_dp_grad_all_reduce"] > 0
        with safe_open(str(run / "data/models/stories260K/model.safetensors"), "pt") as f:
            stored = len(list(f.keys()))
        read = m["construct_tensors_read"]
        assert 0 < read < stored  # rank 0: the embedding and its layers, not stage 1's
        assert f"construct_model_on meta: read {read} stored tensors" in proc.stdout


def test_pipeline_resumes_bitwise_after_sigkill(tokenized, one_f_one_b, tmp_path):
    _, _, stdout = interrupt_then_resume(tokenized, tmp_path, {
        **PIPE, "distributed.pipeline.schedule": "1F1B"}, full=one_f_one_b[0])
    assert "at step 5" in stdout


@pytest.mark.parametrize("overrides, message", [
    ({"training.per_device_train_batch_size": 3}, "does not divide into distributed.pipeline n_microbatches 2"),
    ({"training.dataloader_drop_last": False}, "dataloader_drop_last"),
    ({"training.mixed_precision": "fp16"}, "mixed_precision: fp16"),
    ({"training.torch_compile": True, "distributed.pipeline.schedule": "ZBVZeroBubble"},
     "torch_compile"),
    ({"distributed.nproc_per_node": 1}, "nothing to split"),
    ({"distributed.pipeline.schedule": "1F1B", "distributed.pipeline.stages_per_rank": 2},
     "runs one stage per rank"),
    ({"distributed.pipeline.schedule": "ZBVZeroBubble",
      "distributed.pipeline.pp_stage_type": "loop"}, "needs pp_stage_type v"),
    ({"distributed.pipeline.data_parallel_size": 2},
     "data_parallel_size 2 must divide the world size 2 and leave at least 2 ranks"),
], ids=["divisible", "drop_last", "fp16", "compile-zero-bubble", "world", "stages", "v",
        "replicas"])
def test_pipeline_rules_are_one_line(overrides, message):
    raw = {"data": {"json_file_path": "x.jsonl"}, "distributed": {"strategy": "pipeline",
                                                                  "nproc_per_node": 2},
           "training": {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4}}
    for key, value in overrides.items():
        section, *rest = key.split(".")
        node = raw.setdefault(section, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = value
    with pytest.raises(ValueError, match=message):
        FinetuneConfig.model_validate(raw)


def test_stage_balance_by_parameter_count():
    from engine.modeling.pipeline_stages import balance, stage_ids

    # a heavy first layer and embedding: the first stage takes fewer layers
    assert balance([10, 1, 1, 1, 1, 1], 5, 1, 2) == [range(0, 1), range(1, 6)]
    assert balance([1] * 6, 0, 0, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert stage_ids(0, 2, 2, "loop") == [0, 2] and stage_ids(0, 2, 2, "v") == [0, 3]
