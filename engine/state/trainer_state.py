"""What a run puts in a checkpoint and takes back: position, scheduler, scaler, strategy
extras, monitor, metric history; resume, and load_best_model_at_end. Each takes the run as a
`RunView` (engine/state/run_view.py: the run's declared surface) and reads the components it needs.

The storage format (DCP folders, hashes, rotation) is engine.state.checkpoint; this module decides
the contents, so exact resume is one reviewable place, and `plan_start` is the one rule for
"does this run continue a checkpoint or start fresh" (the train stage's preflight calls it too,
so a refusal comes before any process writes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from engine.reporting.reporters import History, without_measured
from engine.state import checkpoint as ckpt
from engine.state.fingerprint import differences, global_batch_refusal
from engine.state.run_view import RunView
from finetune.config.checkpoint import CheckpointConfig
from finetune.config.distributed import DistributedConfig
from finetune.config.fingerprint import GLOBAL_BATCH, RESHARDABLE
from finetune.errors import PipelineError


def history_rows(reporters) -> list[dict]:
    return reporters.find(History).rows if reporters else []


def save(run: RunView, evaluated: dict) -> Path:
    """Collective: checkpoint the run at its current step."""
    trainer_state = {
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler else None,
        "strategy": run.strategy.trainer_state(),
        # without wall-clock values: the same run saves the same bytes (reruns compare equal)
        "history": [without_measured(row) for row in history_rows(run.reporters)],
        "monitor": run.monitor.state_dict(),
        "callbacks": run.reporters.state_dicts() if run.reporters else {},
    }
    dist_cfg = run.cfg.distributed
    meta = {**run.progress.position(), "world_size": dist_cfg.world_size,
            "samples_in_epoch": run.progress.batch_in_epoch * _micro_batch_samples(run),
            "strategy": dist_cfg.resolved_strategy, "seed": run.cfg.training.seed,
            **evaluated,
            # only a rank that writes meta.json needs it (hashing is not free)
            "fingerprint": run.fingerprint() if run.writes_checkpoint_meta else None}
    make_room(run)
    path = ckpt.save(run.paths.checkpoints, run.progress.step,
                     run.strategy.dcp_state(run.optimizer), trainer_state, meta,
                     run.cfg.checkpoint.save_total_limit, run.monitor.best_by,
                     run.cfg.checkpoint.preserve_n_best, group=run.node_group)
    run.log(f"[train] checkpoint {path}")
    return path


def _micro_batch_samples(run: RunView) -> int:
    """Examples one micro-batch index covers, all data-parallel ranks together: the factor
    between the loader's per-rank position and the global sample count."""
    view = run.strategy.data_view(run.dist)
    return run.cfg.training.per_device_train_batch_size * view.world_size


def check_resumable(meta: dict, path: Path, dist: DistributedConfig) -> None:
    """single, ddp and fsdp2 resume each other's checkpoints on any world size: DCP reshards
    the weights and optimizer state, the data position is a global sample count, and the
    fingerprint checks that the global batch is the same. DiLoCo and pipeline keep per-worker
    or per-stage state that is not resharded: the same world size and strategy only (the
    strategy that ran, `resolved_strategy`: ddp with one process is single)."""
    world, strategy = dist.world_size, dist.resolved_strategy
    was_world, was = meta.get("world_size"), meta.get("strategy", strategy)
    if was in RESHARDABLE and strategy in RESHARDABLE:
        return
    if was_world == world and was == strategy:
        return
    fixed = next((s for s in (was, strategy) if s not in RESHARDABLE), strategy)
    raise PipelineError(
        f"checkpoint {path} was written by strategy {was} with world size {was_world} but "
        f"this run is {strategy} with world size {world}; {fixed} resumes only with the "
        "strategy and world size that wrote it (only single, ddp and fsdp2 reshard): resume "
        f"with distributed.strategy {was} and nproc_per_node x nnodes = {was_world}"
    )


def resumable_shape(meta: dict, dist: DistributedConfig) -> bool:
    """Could this run's strategy and world size continue the checkpoint with `meta`?"""
    try:
        check_resumable(meta, Path(), dist)
    except PipelineError:
        return False
    return True


def _main_decides(choose, d):
    """One process decides (hashing the checkpoint files) and tells the others; a refusal
    there is raised on every rank, so none waits for a partner that has already failed."""
    if d.is_main:
        try:
            outcome = (choose(), None)
        except PipelineError as exc:
            outcome = (None, str(exc))
    else:
        outcome = (None, None)
    if d.world_size > 1:
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=d.main_rank)
        outcome = box[0]
    if outcome[1] is not None:
        raise PipelineError(outcome[1])
    return outcome[0]


@dataclass(frozen=True)
class Start:
    """How a run starts: from `resume` (a checkpoint of this same run) or fresh; a fresh run
    first moves the checkpoints already in the folder aside (`set_aside`)."""

    resume: Path | None
    set_aside: bool
    #: resuming an earlier checkpoint of the folder by path: the ones after this step go aside
    newer_than: int | None = None
    #: the checkpoint is in the run's checkpoint folder (save_on_each_node: each node reads
    #: the same name in its own folder)
    in_folder: bool = True

    @property
    def moves_checkpoints(self) -> bool:
        """Do checkpoints leave the folder before this run writes (set_aside)?"""
        return self.set_aside or self.newer_than is not None


def plan_start(directory: Path, fingerprint: Callable[[], dict[str, Any]],
               ckpt_cfg: CheckpointConfig, dist_cfg: DistributedConfig,
               log: Callable[[str], None], root: Path | None = None) -> Start:
    """resume_from_checkpoint false: fresh. true: the latest valid checkpoint if its
    fingerprint matches this run's (keys in resume_ignore_changes may differ), else refuse
    with the keys that differ. auto (an orchestrator's retry): the same, but a checkpoint of
    another run means a fresh start. A path (relative to `root`): that checkpoint, checked as
    true checks the latest; the folder's later checkpoints (or, for one elsewhere, all of
    them) go aside. `fingerprint` is called only when a checkpoint is there."""
    mode = ckpt_cfg.resume_from_checkpoint
    existing = bool(ckpt.list_checkpoints(directory, validate=False))
    if not mode:
        return Start(None, existing)
    if isinstance(mode, str) and mode != "auto":
        return _plan_from_path(directory, fingerprint, ckpt_cfg, dist_cfg, root, existing)
    path = resume_candidate(mode, directory, root)
    if path is None:
        log(f"[train] resume_from_checkpoint: no valid checkpoint in {directory}; "
            "starting from scratch")
        return Start(None, existing)
    meta = ckpt.read_meta(path) or {}
    if mode is True:
        check_resumable(meta, path, dist_cfg)
    changed = _changed(meta, fingerprint, ckpt_cfg)
    if not changed:
        return Start(path, False)
    what = "; ".join(f"{k}: {v}" for k, v in changed.items())
    aside = directory.with_name(directory.name + ckpt.PREVIOUS)
    if mode is True:
        _refuse_another_global_batch(path, meta, fingerprint, changed)
        raise PipelineError(
            f"checkpoint {path} belongs to another run ({what}); resuming it would continue "
            "that run under these params: restore them, list the keys in "
            "checkpoint.resume_ignore_changes, or set checkpoint.resume_from_checkpoint to "
            f"false or auto to start fresh (its checkpoints then move to {aside})")
    log(f"[train] resume_from_checkpoint auto: {path} belongs to another run ({what}); "
        f"starting fresh (its checkpoints move to {aside})")
    return Start(None, True)


def _refuse_another_global_batch(path: Path, meta: dict, fingerprint,
                                 changed: dict[str, Any]) -> None:
    """A resume onto another world size must keep the examples per step: one line naming
    both splits and the key that restores it (the other changed keys after it)."""
    line = (global_batch_refusal(path, meta.get("fingerprint") or {}, fingerprint())
            if GLOBAL_BATCH in changed else None)
    if line is None:
        return
    others = "; ".join(f"{k}: {v}" for k, v in changed.items() if k != GLOBAL_BATCH)
    raise PipelineError(line + (f" (this run also changes {others})" if others else ""))


def _changed(meta: dict, fingerprint, ckpt_cfg: CheckpointConfig) -> dict[str, Any]:
    return {k: v for k, v in differences(meta.get("fingerprint"), fingerprint()).items()
            if k not in ckpt_cfg.resume_ignore_changes}


def resume_candidate(mode: bool | str, directory: Path, root: Path | None) -> Path | None:
    """The checkpoint a resume considers: none (false), the one named (a path), or the
    latest valid one in `directory` (true, auto). plan_start decides with it, and the train
    stage asks it which checkpoint a null training.seed continues (engine.preflight)."""
    if not mode:
        return None
    if isinstance(mode, str) and mode != "auto":
        return named_checkpoint(mode, root)
    return ckpt.latest(directory)


def named_checkpoint(value: str, root: Path | None) -> Path:
    """resume_from_checkpoint's path: absolute, or relative to the project root."""
    given = Path(value).expanduser()
    return given if given.is_absolute() or root is None else root / given


def resumable_path(value: str, root: Path | None, dist_cfg: DistributedConfig) -> tuple[Path, dict]:
    """resume_from_checkpoint's named checkpoint and its meta record: a complete checkpoint,
    this run's strategy and world size can continue (what can be told without hashing files)."""
    path = named_checkpoint(value, root)
    if not ckpt.is_valid(path):
        raise PipelineError(
            f"checkpoint.resume_from_checkpoint: {path} is not a complete checkpoint (missing, "
            "half-written or failing its SHA-256 check); name a step-* folder of a finished "
            "save, or true for the latest")
    meta = ckpt.read_meta(path) or {}
    check_resumable(meta, path, dist_cfg)
    return path, meta


def _plan_from_path(directory: Path, fingerprint, ckpt_cfg: CheckpointConfig,
                    dist_cfg: DistributedConfig, root: Path | None, existing: bool) -> Start:
    """resume_from_checkpoint: <path> (HF's resume_from_checkpoint path)."""
    path, meta = resumable_path(ckpt_cfg.resume_from_checkpoint, root, dist_cfg)
    changed = _changed(meta, fingerprint, ckpt_cfg)
    if changed:
        _refuse_another_global_batch(path, meta, fingerprint, changed)
        what = "; ".join(f"{k}: {v}" for k, v in changed.items())
        raise PipelineError(
            f"checkpoint {path} belongs to another run ({what}); restore its params or list "
            "the keys in checkpoint.resume_ignore_changes")
    inside = path.resolve().parent == directory.resolve()
    if inside:
        return Start(path, False, newer_than=int(meta["step"]))
    return Start(path, existing, in_folder=False)


def make_room(run: RunView) -> None:
    """Every rank, before the run's first write into the checkpoint folder (its first
    checkpoint, or its trained model when it saves none): the earlier run's checkpoints
    leave the folder now, not at start-up, so a run stopped before it saved anything leaves
    them where they were (and the workspace as DVC recorded it)."""
    if run.start.moves_checkpoints and run.writes_checkpoint_meta:
        set_aside(run)
    run.start = replace(run.start, set_aside=False, newer_than=None)  # done: once per run


def belongs_to_run(meta: dict, fingerprint: Callable[[], dict[str, Any]],
                   ckpt_cfg: CheckpointConfig, ignore: tuple[str, ...] = ()) -> bool:
    """Would a resume (true) of this run continue the checkpoint with `meta`?"""
    return not set(_changed(meta, fingerprint, ckpt_cfg)) - set(ignore)


def set_aside(run: RunView) -> None:
    """The main rank (a node's first with save_on_each_node), before its first write: the
    earlier run's checkpoints leave the folder (after a resume by path, those later than
    the resumed one)."""
    moved, deleted = ckpt.set_aside(run.paths.checkpoints, run.cfg.checkpoint.keep_previous_runs,
                                    after_step=run.start.newer_than)
    for old in deleted:
        run.log(f"[train] removed earlier checkpoints {old} (checkpoint.keep_previous_runs "
                f"{run.cfg.checkpoint.keep_previous_runs})")
    if moved is not None:
        run.log(f"[train] fresh run: earlier checkpoints moved to {moved}")


def _load(run: RunView, path: Path) -> tuple[dict, dict]:
    optimizer, strategy = run.optimizer, run.strategy
    return ckpt.load(path, strategy.dcp_state(optimizer),
                     lambda state: strategy.load_dcp_state(optimizer, state),
                     group=run.node_group)


def _on_this_node(run: RunView, plan: Start) -> Start:
    """save_on_each_node: the main rank chose a checkpoint of its folder; this node resumes
    its own copy of it (same name, this node's folder), which its first rank checks whole."""
    if run.node_group is None or plan.resume is None or not plan.in_folder:
        return plan
    local = run.paths.checkpoints / plan.resume.name
    if run.dist.leads_another_node and not ckpt.is_valid(local):
        raise PipelineError(
            f"checkpoint.save_on_each_node: node {run.cfg.distributed.node_rank} has no complete "
            f"copy of {plan.resume.name} in {run.paths.checkpoints} (missing, half-written or "
            "failing its SHA-256 check); resume from a checkpoint every node kept, or start fresh")
    return replace(plan, resume=local)


def load_best(run: RunView) -> int | None:
    """load_best_model_at_end: the best kept checkpoint's weights become the trained model."""
    monitor = run.monitor
    path = _main_decides(lambda: ckpt.best(run.paths.checkpoints, monitor.best_by), run.dist)
    if path is None:
        run.log("[train] load_best_model_at_end: no checkpoint with a metric; keeping the "
                "final weights")
        return None
    _, meta = _load(run, path)
    run.log(f"[train] load_best_model_at_end: {path.name} ({monitor.metric} "
            f"{meta.get(monitor.metric):.6g})")
    return meta.get("step")


def start(run: RunView) -> tuple[Start, list[dict]]:
    """Decide how the run starts (main rank, shared with the others) and restore the
    checkpoint it continues; returns the plan and the logged rows the checkpoint held."""
    cfg = run.cfg
    plan = _on_this_node(run, _main_decides(
        lambda: plan_start(run.paths.checkpoints, run.fingerprint, cfg.checkpoint,
                           cfg.distributed, run.log, run.paths.project_root), run.dist))
    return plan, (_restore(run, plan.resume) if plan.resume is not None else [])


def _restore(run: RunView, path: Path) -> list[dict]:
    trainer_state, meta = _load(run, path)
    run.scheduler.load_state_dict(trainer_state["scheduler"])
    if run.scaler and trainer_state.get("scaler"):
        run.scaler.load_state_dict(trainer_state["scaler"])
    run.strategy.load_trainer_state(trainer_state.get("strategy", {}))
    run.monitor.load_state_dict(trainer_state.get("monitor", {}))
    run.callback_states = trainer_state.get("callbacks", {})
    run.progress.restore(meta, _micro_batch_samples(run))
    run.log(f"[train] resumed from {path} at step {run.progress.step}")
    return trainer_state.get("history", [])
