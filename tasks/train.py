"""Stage 4, train: launch `torchrun` on the engine worker with the validated config.

Single-process runs go through torchrun too (nproc_per_node 1), so the code a user tests on a
laptop is the code that runs on 8 GPUs. The stage opens the MLflow run, hands its id to the
worker (rank 0 logs per-step metrics into it), and records it next to the trained model.
torchrun is started before the checks and the MLflow run so its start-up overlaps them
(tasks/launch.py: rank 0 waits for the stage's go before it writes anything).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from engine import preflight as preflight_engine
from finetune.files import write_json_atomic
from finetune.workspace import Workspace
from tasks import model_refs, tracking
from tasks.launch import run_paths, train_metrics
from tasks.launchers import launch
from tasks.wandb_tracking import WandbRun, wandb_module


def preflight(ws: Workspace) -> None:
    """Checks that need the machine; they run while torchrun starts, and rank 0 writes
    nothing until they passed (tasks/launch.py). The engine's own checks come through its
    door (engine.preflight: user code, the machine, the data the workers read, the resume);
    the stage adds what only the pipeline knows (a streamed source's train split, W&B)."""
    cfg = ws.config
    if cfg.data.streaming:
        from tasks.stream import holdout_rows, open_source

        for name, part in cfg.data.parts():  # each training source's train split exists
            if not cfg.data.eval_only(name):
                holdout_rows(part, open_source(part, ws.root))
    preflight_engine.check_before_launch(cfg, run_paths(ws))
    if "wandb" in cfg.logging.report_to:
        wandb_module()


RESUME_ENV = "FINETUNE_RESUME"
#: the sample table a method that generates writes beside its curves at logging steps (its
#: prompts, completions and rewards), logged to MLflow
SAMPLES = "train_samples.jsonl"


def with_resolved_seed(ws: Workspace) -> Workspace:
    """`training.seed: null` (unseeded): draw the seed here, once, so every rank
    gets the same one and the MLflow run, the train metrics and each checkpoint record it.
    A resume continues with the seed of the checkpoint it picks (data order and dropout
    depend on it; the fingerprint then matches)."""
    if ws.config.training.seed is not None:
        return ws
    seed = preflight_engine.seed_of_resumed_checkpoint(ws.config, run_paths(ws))
    how = "continuing the checkpoint's seed" if seed is not None else "drew seed"
    if seed is None:
        seed = secrets.randbelow(2**31)
    print(f"[train] training.seed null: {how} {seed}", flush=True)
    cfg = ws.config.model_copy(deep=True)
    cfg.training.seed = seed
    return Workspace(config=cfg, root=ws.root, params_path=ws.params_path)


def train(ws: Workspace) -> dict[str, Path]:
    if os.environ.get(RESUME_ENV) == "1" and not ws.config.checkpoint.resume_from_checkpoint:
        # An orchestrator retry: continue from the latest checkpoint if it is this run's (the
        # fingerprint says), else start fresh. Exact resume gives the same weights, so this
        # is not a change of params.
        cfg = ws.config.model_copy(deep=True)
        cfg.checkpoint.resume_from_checkpoint = "auto"
        ws = Workspace(config=cfg, root=ws.root, params_path=ws.params_path)
        print(f"[train] {RESUME_ENV}=1: resuming from the latest checkpoint of this run, "
              "if there is one", flush=True)
    ws = model_refs.resolved(ws)  # models:/ references -> their downloaded files
    if ws.config.checkpoint.resume_from_checkpoint is True:
        preflight_engine.check_world_size(ws.config, ws.layout.checkpoints)
    if ws.config.distributed.node_rank > 0:  # its workers take node 0's seed (engine.recipe.run)
        preflight(ws)
        return _train_worker_node(ws)
    ws = with_resolved_seed(ws)
    launched = time.time()
    with launch(ws) as job:  # starts now: worker start-up overlaps the checks below
        try:
            preflight(ws)
            run_id = tracking.start_run(ws)
        except BaseException as exc:
            job.abort(str(exc))
            raise
        wandb_run = None
        try:
            _log_tokenize_stats(ws, run_id)
            relays = []
            if "mlflow" in ws.config.logging.report_to:
                relays.append(tracking.step_logger(ws, run_id))
            if "wandb" in ws.config.logging.report_to:
                wandb_run = WandbRun(ws, run_id, tracking.run_lineage(ws, run_id))
                relays.append(wandb_run.log)
            job.go(_fan_out(relays))  # also keeps the step reached (interrupted_summary)
            job.wait()
        except BaseException:
            tracking.finish_run(ws, run_id, "FAILED")
            if wandb_run is not None:
                wandb_run.finish(ok=False)
            raise
    metrics = train_metrics(ws)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
    curves = SERIES if "mlflow" in ws.config.logging.report_to else set()
    tracking.set_tags(ws, run_id, run_facts(metrics, curves))
    if wandb_run is not None:
        wandb_run.summary(numbers)
        wandb_run.finish(ok=True)
    for plot in ("train.csv", "eval.csv", SAMPLES):
        path = ws.layout.plots / plot
        # a method's sample table: only when this run wrote it (not an earlier run's)
        if plot != SAMPLES or (path.exists() and path.stat().st_mtime >= launched):
            tracking.client(ws).log_artifact(run_id, str(path), "plots")
    write_json_atomic(ws.layout.train_run, {"mlflow_run_id": run_id})
    # the training is over: the run ends here, FINISHED (evaluate and export, if they run,
    # log into it afterwards); a stage run on its own leaves no run RUNNING forever
    tracking.finish_run(ws, run_id)
    return {"trained": ws.layout.trained, "checkpoints": ws.layout.checkpoints}


def interrupted_summary(ws: Workspace) -> str:
    """What a user needs after stopping training (Ctrl-C, a scheduler's SIGTERM): the step it
    reached (the last row the job logged), this run's newest checkpoint and how to resume (an
    earlier run's checkpoint, which the resume would refuse, is not offered)."""
    parts = [f"reached step {REACHED['step']}"] if "step" in REACHED else []
    newest = preflight_engine.checkpoint_of_this_run(ws.config, run_paths(ws))
    if newest is None:
        earlier = preflight_engine.newest_checkpoint(ws.layout.checkpoints) is not None
        parts.append("no checkpoint of this run yet" + (
            f" ({ws.layout.checkpoints.relative_to(ws.root)} keeps an earlier run's, "
            "untouched)" if earlier else "") + "; start again with: finetune stage train "
            "(checkpoint.save_steps sets how often one is written)")
    else:
        path, meta = newest
        parts.append(f"last checkpoint {path.relative_to(ws.root)} (step {meta['step']}); "
                     "resume with: finetune stage train -s "
                     "checkpoint.resume_from_checkpoint=true")
    return "; ".join(parts)


#: the last training step the running job logged (read when the stage is interrupted)
REACHED: dict[str, int] = {}
#: the names the running job logged per step (MLflow has them as curves)
SERIES: set[str] = set()


def run_facts(metrics: dict, series: set[str]) -> dict[str, str]:
    """`data/metrics/train.json` less the values MLflow already has as per-step curves, as
    tags `train.<key>` (seed, world size, parameter counts, runtime, mean loss): one number
    each, which the metrics page would draw as a chart of a single bar."""
    return {f"train.{k}": str(v) for k, v in metrics.items()
            if k not in series and v is not None}


def _fan_out(relays: list):
    """One relay callable that hands each row to every tracker (MLflow, W&B) and notes the
    step reached."""
    REACHED.clear()
    SERIES.clear()

    def relay(row: dict) -> None:
        if "loss" in row and "step" in row:
            REACHED["step"] = int(row["step"])
        SERIES.update(k for k in row if k != "step")
        for each in relays:
            each(row)

    return relay


def _log_tokenize_stats(ws: Workspace, run_id: str) -> None:
    """The data as MLflow records data (tracking.log_data_inputs): the tokenized splits as the
    run's dataset inputs, their statistics as a table artifact; the run's metrics stay the
    model's."""
    stats_file = ws.layout.metrics / "tokenize.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    tracking.log_data_inputs(ws, run_id, ws.layout.tokenized, stats)


def _train_worker_node(ws: Workspace) -> dict[str, Path]:
    """node_rank > 0 of a multi-node job: run this node's ranks; node 0 (global rank 0) owns
    the MLflow run and writes the trained model, metrics and checkpoints (shared storage)."""
    with launch(ws, handshake=False) as job:
        job.wait()
    print(f"[train] node {ws.config.distributed.node_rank} finished; node 0 writes the outputs",
          flush=True)
    return {}
