"""Pipeline parallelism (`distributed.strategy: pipeline`) under real torchrun, 2 processes on
gloo: the stages' training equals single-process training on the same batches, a SIGKILLed
run resumes bitwise from its per-stage DCP checkpoint, and the export is one normal folder.

Its own file so it runs beside test_strategies.py (pytest-xdist, one file per worker)."""

from __future__ import annotations

import re
import shutil

import pytest
from helpers import (
    adapter,
    assert_weights_close,
    interrupt_then_resume,
    losses,
    train_copy_here,
    train_here,
    train_metrics,
    train_stage_here,
    write_params,
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
    return train_copy_here(tokenized, tmp_path_factory.mktemp("1f1b") / "p", {
        **PIPE, "distributed.pipeline.schedule": "1F1B"})


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBVZeroBubble"])
def test_pipeline_trains_like_one_process(tokenized, single, single_double_batch, one_f_one_b,
                                          tmp_path, schedule):
    """1F1B: one stage per rank; ZBVZeroBubble: 2 stages per rank in a V, the zero-bubble split
    backward. GPipe runs pipeline x data parallel on 4 processes (2 replicas of a 2-stage
    pipeline, batch 4 each = one process with batch 8) and builds its model on meta: each rank
    reads only its stage's tensors from the checkpoint."""
    extra = {"training.construct_model_on": "meta", "distributed.nproc_per_node": 4,
             "distributed.pipeline.data_parallel_size": 2} if schedule == "GPipe" else {}
    run, proc = one_f_one_b if schedule == "1F1B" else train_copy_here(
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


@pytest.mark.distributed
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


SPLITTER = """
def first_layer_alone(model, stages):
    assert stages == 2, stages
    return [(0, 1), (1, len(model.model.layers))]
"""


@pytest.mark.distributed
def test_model_splitter_and_the_debug_switches(tokenized, single, tmp_path):
    """distributed.pipeline.model_splitter cuts the stages where it says (training is still
    single-process training); the four debug switches print the split, the schedule's steps
    and each micro-batch's losses, each rank's parameters and what each rank built."""
    project = tmp_path / "pp"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "split_here.py").write_text(SPLITTER)
    write_params(project, {
        **PIPE, "distributed.pipeline.schedule": "1F1B",
        "distributed.pipeline.model_splitter": "split_here:first_layer_alone",
        **{f"distributed.pipeline.debug_{what}": True
           for what in ("split_model", "pipeline", "model_params", "model_init")}})
    out = train_stage_here(project).stdout
    assert "2 stages (0: layers 0-0, 1: layers 1-4)" in out
    assert losses(project) == pytest.approx(losses(single), abs=1e-5)
    # debug_split_model: rank 0, each stage's parts and parameter count
    split = next(line for line in out.splitlines() if line.startswith("[pipeline] split: "))
    assert "stage 0: embed_tokens, layers 0-0: " in split and "(rank 0)" in split
    assert "stage 1: layers 1-4, norm, lm_head: " in split and "(rank 1)" in split
    assert " trainable)" in split
    # debug_pipeline: per training micro-batch, what each rank's stage ran, in order (1F1B:
    # rank 0 runs both forwards before the first backward, the last stage alternates), and
    # the last stage's loss of each pipeline micro-batch
    steps = re.findall(r"\[pipeline rank (\d)\] micro-batch of 4 rows, 2 pipeline "
                       r"micro-batches of 2: ([\dFB ]+)"
                       r"(?:, summed losses (\d+\.\d+) (\d+\.\d+))?", out)
    assert [s[1] for s in steps if s[0] == "0"] == ["0F0 0F1 0B0 0B1"] * 10, out
    last = [s for s in steps if s[0] == "1"]
    assert [s[1] for s in last] == ["1F0 1B0 1F1 1B1"] * 10
    assert all(float(s[2]) > 0 and float(s[3]) > 0 for s in last)
    # debug_model_params: each rank's own parameters only
    params = re.findall(r"\[pipeline rank (\d)\] param (\S+) \(", out)
    rank0 = {name for rank, name in params if rank == "0"}
    rank1 = {name for rank, name in params if rank == "1"}
    assert any("layers.0." in n for n in rank0) and not any("layers.1." in n for n in rank0)
    assert any("layers.4." in n for n in rank1) and not any("layers.0." in n for n in rank1)
    assert re.search(r"\[pipeline rank 1\] param \S+lora_A\S+ \(\d+, \d+\) float32 cpu "
                     r"trainable", out), out
    # debug_model_init: what each rank built
    assert re.search(r"\[pipeline rank 0\] init: stages 0 \(Stage: 1 layers, embed_tokens\); "
                     r"construct_model_on \w+; [\d,]+ parameters on cpu .*output layer "
                     r"elsewhere", out), out
    assert re.search(r"\[pipeline rank 1\] init: stages 1 \(Stage: 4 layers, norm\); .* 0 still "
                     r"on meta; output layer here", out), out


@pytest.mark.parametrize("spans, says", [
    ([(0, 2)], "1 spans for 2 stages"),
    ([(0, 2), (3, 5)], "span 3-5 does not start where the last one ended (2)"),
    ([(0, 2), (2, 4)], "they end at layer 4, the model has 5"),
    ([(0, 0), (0, 5)], "span 0-0 is empty"),
    ([(1, 2), (2, 5)], "span 1-2 does not start where the last one ended (0)"),
    (3, "not a list of (start, end) pairs"),
])
def test_a_model_splitter_with_wrong_spans_is_one_line(spans, says):
    from engine.modeling.pipeline_stages import check_spans
    from finetune.errors import PipelineError

    with pytest.raises(PipelineError, match=re.escape(
            f"distributed.pipeline.model_splitter: 'm:f' returned {spans!r}: {says}; it must "
            "return 2 (start, end) layer spans, end exclusive, that cover layers 0-4 in order")):
        check_spans(spans, 5, 2, "m:f")
    assert check_spans([(0, 1), range(1, 5)], 5, 2, "m:f") == [range(0, 1), range(1, 5)]
