"""The config fuzzer: configs drawn from the pydantic schema itself must be refused with one
line naming a key, or run.

Every leaf of the schema is drawable, with a strategy made from its own annotation: Literal
choices, bools, ints and floats within the field's bounds (clipped to what two steps on a tiny
model can run), an optional value's None. A draw changes a few keys at once, in any sections,
on top of one of a few bases (the shrunk default; a DiLoCo run; a pipeline-ready one), so the
combinations across sections are what is explored; a new field is fuzzed without new test
code. Each draw is validated as `finetune validate` does (the schema, the compatibility table,
the data-free checks of tasks/checks.py). A refusal must be one `PipelineError` line naming a
key of the schema; a config that passes must run 2 optimizer steps of the in-process run
object on the shipped tiny model, and one draw in eight first goes through the format and
tokenize stages with its data keys. Anything else (another exception, a multi-line message)
is a bug this test exists to find.

Not drawn (left at the base's value): free strings (paths, hub ids, `module:name` references:
their own tests cover them), the process layout (nproc_per_node, nnodes, node_rank, rdzv: a
draw runs in this process) and `report_to: wandb` (a W&B run is the train stage's). The
compile backend is `eager` (inductor would compile for minutes per draw on a CPU).

`make fuzz` runs FUZZ_EXAMPLES draws (default 2000) with a new seed each time and prints the
seed; FUZZ_SEED=<seed> draws the same sequence again, and a failing draw is printed as the
overrides that make it (paste them into `finetune validate -s KEY=VALUE ...`).
"""

from __future__ import annotations

import json
import os
import shutil
import types
import typing
from dataclasses import replace
from pathlib import Path

import annotated_types
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY, as_a_worker, copy_project, stages_here
from finetune.config.loader import _all_keys, set_keys, validate_raw
from finetune.config.schema import FinetuneConfig
from finetune.config.section import section_model
from finetune.errors import PipelineError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
SEED = os.environ.get("FUZZ_SEED")

#: keys never drawn (see the module docstring)
NOT_DRAWN = ("distributed.nproc_per_node", "distributed.nnodes", "distributed.node_rank",
             "distributed.rdzv_", "data.sources", "data.streaming")
#: the ranges drawn for keys whose schema bounds allow more than two steps can run
CLIP = {"training.max_steps": (-1, 3), "training.num_train_epochs": (0.0, 0.2),
        "training.per_device_train_batch_size": (1, 8),
        "training.per_device_eval_batch_size": (1, 8),
        "training.gradient_accumulation_steps": (1, 3), "data.max_seq_length": (8, 600),
        "training.dataloader_num_workers": (0, 2), "training.epoch_train_steps": (1, 3),
        "distributed.diloco.inner_steps": (1, 3), "distributed.diloco.diloco_loops": (1, 3)}
BASES = {
    "default": {},
    "diloco": {"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 1,
               "distributed.diloco.diloco_loops": 2, "eval.eval_steps": 1,
               "checkpoint.save_steps": 1},
    "fsdp2": {"distributed.strategy": "fsdp2", "distributed.fsdp.reshard_after_forward": True},
}
#: every base: two steps of small batches of short rows, no checkpoint unless drawn; a draw
#: that compiles gets the eager backend (check_draw: it is refused without torch_compile)
COMMON = {**TINY, "training.max_steps": 2,
          "data.max_seq_length": 160, "data.max_train_samples": 16, "data.max_eval_samples": 4,
          "data.max_dropped_fraction": 0.9, "training.per_device_train_batch_size": 2,
          "training.per_device_eval_batch_size": 2, "checkpoint.save_strategy": "no",
          "eval.eval_steps": 2, "eval.generation_max_new_tokens": 4,
          "eval.max_generation_samples": 2}


def _bounds(field, integer: bool) -> tuple[float | None, float | None]:
    step = 1 if integer else 1e-6
    lo = hi = None
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Ge):
            lo = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            lo = meta.gt + step
        elif isinstance(meta, annotated_types.Le):
            hi = meta.le
        elif isinstance(meta, annotated_types.Lt):
            hi = meta.lt - step
    return lo, hi


def _plain(annotation, field, key: str):
    """A strategy for one non-None type of a field (None: not drawn)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from([a for a in args if a != "wandb"])
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        lo, hi = CLIP.get(key) or _bounds(field, annotation is int)
        lo = -2 if lo is None else lo
        hi = lo + 64 if hi is None else min(hi, lo + 64)
        if annotation is int:
            return st.integers(int(lo), int(hi))
        return st.floats(float(lo), float(hi), allow_nan=False, allow_infinity=False)
    if origin is list and args and typing.get_origin(args[0]) is typing.Literal:
        return st.lists(st.sampled_from([a for a in typing.get_args(args[0])
                                         if a != "wandb"]), unique=True, max_size=3)
    return None


def strategy_for(key: str, field):
    """A field's values: its annotation's, plus None where it is optional, plus its
    default."""
    annotation = field.annotation
    args = typing.get_args(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    parts = [_plain(a, field, key) for a in (args if union else (annotation,))
             if a is not type(None)]
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if union and type(None) in args:
        parts.append(st.none())
    return st.one_of(*parts)


def _fields() -> dict:
    out = {}

    def walk(model, prefix: str):
        for name, field in model.model_fields.items():
            sub = section_model(field.annotation)
            key = f"{prefix}{name}"
            if sub is not None and typing.get_origin(field.annotation) is not list:
                walk(sub, key + ".")
            elif not key.startswith(NOT_DRAWN):
                strategy = strategy_for(key, field)
                if strategy is not None:
                    out[key] = strategy
    walk(FinetuneConfig, "")
    return out


FIELDS = _fields()
KEYS = set(_all_keys())


@st.composite
def drawn_configs(draw):
    base = draw(st.sampled_from(sorted(BASES)))
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=5, unique=True))
    overrides = {k: draw(FIELDS[k]) for k in keys}
    stages = draw(st.integers(0, 7)) == 0
    return base, overrides, stages


def _names_a_key(message: str) -> bool:
    sections = {k.split(".")[0] for k in KEYS}
    return any(k in message for k in KEYS) or any(f"{s}:" in message or f"{s}." in message
                                                   for s in sections)


def check_draw(project: Path, work: Path, base: str, overrides: dict, stages: bool) -> str:
    """'refused' or 'ran' (or fails the test): what the module docstring says of a draw."""
    from engine.worker import run_job
    from finetune.workspace import Workspace
    from tasks.checks import check_without_data
    from tasks.launch import job_spec
    from tasks.train import with_resolved_seed

    drawn = {**BASES[base], **overrides}
    if drawn.get("training.torch_compile") and "training.torch_compile_backend" not in drawn:
        drawn["training.torch_compile_backend"] = "eager"  # see COMMON
    raw = set_keys(project_params(project), drawn)
    try:
        cfg = validate_raw(raw, source="p.yaml")
        ws = Workspace(config=cfg, root=project, params_path=project / "params/default.yaml")
        with as_a_worker(project):
            check_without_data(ws)
    except PipelineError as exc:
        message = str(exc)
        assert "\n" not in message and _names_a_key(message), message
        return "refused"
    try:
        if stages and any(k.startswith("data.") for k in overrides):
            project = _with_data_stages(project, work, raw)
            ws = Workspace(config=cfg, root=project,
                           params_path=project / "params/default.yaml")
        ws = with_resolved_seed(ws)  # as the train stage does before it launches
        spec = job_spec(ws)
        paths = replace(spec.paths, checkpoints=work / "checkpoints", trained=work / "trained",
                        metrics_file=work / "metrics/train.json", plots_dir=work / "plots")
        with as_a_worker(project):
            run_job(replace(spec, paths=paths))
    except PipelineError as exc:  # bad data or input only a run can tell: one line
        message = str(exc)
        assert "\n" not in message, message
        return "refused"
    steps = json.loads((work / "metrics/train.json").read_text())["global_step"]
    assert steps >= 1
    return "ran"


def project_params(project: Path) -> dict:
    import yaml

    return yaml.safe_load((project / "params/default.yaml").read_text())


def _with_data_stages(project: Path, work: Path, raw: dict) -> Path:
    """A copy of the project whose data stages ran with the drawn data keys."""
    import yaml

    copy = work / "project"
    shutil.copytree(project, copy, symlinks=True)
    (copy / "params/default.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    stages_here(copy, "download", "format", "tokenize")
    return copy


@pytest.fixture(scope="module")
def fuzz_project(tmp_path_factory):
    project = copy_project(tmp_path_factory.mktemp("fuzz") / "p", COMMON)
    stages_here(project, "download", "format", "tokenize")
    return project


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize=SEED is None and EXAMPLES <= 200,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def test_drawn_configs_are_refused_in_one_line_or_run(fuzz_project, tmp_path_factory):
    outcomes = {"refused": 0, "ran": 0}

    @SETTINGS
    @given(drawn_configs())
    def draw(case):
        base, overrides, stages = case
        work = tmp_path_factory.mktemp("draw")
        try:
            outcomes[check_draw(fuzz_project, work, base, overrides, stages)] += 1
        except BaseException:
            print(f"failing draw: base {base}, overrides {json.dumps(overrides)}, "
                  f"data stages: {stages}")
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)

    if SEED is not None:
        draw = __import__("hypothesis").seed(int(SEED))(draw)
    draw()
    print(f"fuzz: {outcomes['refused']} refused, {outcomes['ran']} ran")
    assert outcomes["ran"] >= EXAMPLES // 5 and outcomes["refused"] >= EXAMPLES // 5, outcomes
