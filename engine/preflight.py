"""The validate and train stages' door into the engine: what is checked before torchrun's
workers may write, and what a run's start is decided by (which checkpoint it continues, with
which seed).

tasks/train.py imports this module and no other engine module, so a new "check before launch"
is added here, next to the engine code it checks, not in the stage; `finetune validate`
(tasks/checks.py) runs the same user-code and machine checks, and its checks of the model
(from config.json alone) and of the resume target, here too. Every decision here is the one the
worker takes again (engine.state.trainer_state.plan_start, resume_candidate): one rule, asked twice,
so a refusal comes before any process writes. eval.harness's tasks are resolved here as the
evaluate stage and in-training evaluation resolve them (engine.evaluation.harness).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.evaluation.harness import INSTALL, require_lm_eval, resolve_tasks  # noqa: F401
from engine.process.job import RunPaths
from engine.reporting.profiler import check_traces_dir
from finetune.config import FinetuneConfig
from finetune.config.section import code_refs
from finetune.errors import PipelineError
from finetune.imports import load_object

#: a `model_ref` role (finetune.config.model_refs) -> the engine's check that a folder holds
#: such a model: (project root, the folder, its entry for the message) -> the folder, or one
#: line naming the entry. Imported when asked, so the role's room loads only for its runs
MODEL_FOLDER_CHECKS = {"reward_model": "engine.rollout.reward_model:check_reward_model",
                       "teacher": "engine.recipe.distill.teacher:check_teacher"}


def check_model_folder(role: str, root: Path, ref: str, entry: str) -> Path:
    """The folder a `model_ref` key names holds what its role needs (MODEL_FOLDER_CHECKS):
    `finetune validate` and the stages that load it ask here (tasks.model_refs)."""
    return load_object(MODEL_FOLDER_CHECKS[role], entry)(root, ref, entry)


#: model classes that need no check (transformers has them)
TRANSFORMERS_CLASSES = ("AutoModelForCausalLM", "AutoModelForSequenceClassification")


def device_for(cfg: FinetuneConfig) -> torch.device:
    """The device a run of this config gets on this machine."""
    from engine.process.distributed import choose_device

    return choose_device(cfg.training.resolved_device)


def check_user_code_and_machine(cfg: FinetuneConfig, device: torch.device) -> None:
    """The classes and functions the params name load and are what they must be; what this
    device cannot run is refused (finetune/config/compat.py's machine rows). The functions are
    every key whose field says `code_ref=True` (finetune.config.section.Field), so a new
    section's user-code keys are checked here without an edit; the classes (model, optimizer,
    scheduler, callbacks, trainer type) have their own checks below. Each check is imported
    only when the params ask for what it checks (the engine's imports are most of what
    `finetune validate` costs)."""
    from finetune.config.compat import check_machine

    t = cfg.training
    check_machine(cfg, device)
    if cfg.model.auto_class_name not in TRANSFORMERS_CLASSES:
        from engine.modeling.model import model_class

        model_class(cfg.model.auto_class_name)
    if cfg.logging.callbacks:
        from engine.reporting.callbacks import check_user_callback

        for spec in cfg.logging.callbacks:
            check_user_callback(spec)
    from engine.strategies import check_strategy_optimizers, strategy_optimizers

    refs = [(cfg.optimizer.name, "optimizer.name"), *strategy_optimizers(cfg.distributed)]
    if any(":" in name for name, _ in refs) or ":" in cfg.scheduler.name:
        from engine.objective.optim import optimizer_class, scheduler_factory

        for name, key in refs:
            optimizer_class(name, key)
        scheduler_factory(cfg.scheduler.name)
    check_strategy_optimizers(cfg.distributed)
    if t.type != "sft":
        from engine.recipe.run import trainer_class  # imported there: the registry knows sft

        trainer_class(t.type)
    for key, ref in code_refs(cfg):  # the fields marked code_ref (finetune.config.section)
        if ref and not callable(load_object(ref, key)):
            raise PipelineError(f"{key}: '{ref}' is not a function")
    if t.fused_loss_factory:
        from engine.objective.fused import check_factory

        check_factory(t.fused_loss_factory)
    if cfg.model.load_in_4bit or cfg.model.load_in_8bit:
        from engine.modeling.model import check_quantization

        check_quantization(cfg.model)
    if t.fp8_recipe or t.qat_recipe:
        from engine.modeling.quantization import check_low_precision

        check_low_precision(cfg, device)


def check_model(cfg: FinetuneConfig, root: Path) -> None:
    """`finetune validate`'s model checks, from config.json alone: the model kind's
    architecture check, data.max_seq_length within its positions, a tokenizer of its own
    within its embeddings, and the adapter's target modules (names matched as peft matches
    them, on a weightless skeleton built on the meta device)."""
    from engine.kinds import kind_of
    from engine.modeling.model import load_model_config

    kind = kind_of(cfg)  # a project's kind ('module:Class') that does not load: one line
    if cfg.model.model_init:  # a factory builds the model: nothing to read before it runs
        return
    config = load_model_config(cfg.model, root)
    kind.check_architecture(config, f"model.name_or_path {cfg.model.name_or_path}")
    check_positions(cfg, config)
    check_vocabulary(cfg, root, config)
    if cfg.peft.use_peft:
        _check_targets(cfg, config)


def check_positions(cfg, model_config) -> None:
    """data.max_seq_length within the model's positions (max_position_embeddings)."""
    limit = (getattr(model_config, "max_position_embeddings", None)
             or getattr(model_config, "n_positions", None))
    if limit and cfg.data.max_seq_length > limit:
        raise PipelineError(
            f"data.max_seq_length {cfg.data.max_seq_length} exceeds the model's "
            f"max_position_embeddings {limit}; set data.max_seq_length <= {limit}")


def check_vocabulary(cfg: FinetuneConfig, root: Path, model_config) -> None:
    """A tokenizer other than the model's (model.tokenizer_name_or_path) with more tokens than
    the model has embedding rows trained into an IndexError at the first unknown id. The
    embeddings grow only with model.added_tokens or special_tokens (to the tokenizer's
    length: engine.modeling.vocabulary), so without them such a tokenizer is refused here."""
    model = cfg.model
    rows = getattr(model_config, "vocab_size", None)
    if not model.tokenizer_name_or_path or not rows or model.added_tokens or model.special_tokens:
        return
    from engine.modeling.model import load_tokenizer

    size = len(load_tokenizer(model, root))
    if size > rows:
        raise PipelineError(
            f"model.tokenizer_name_or_path '{model.tokenizer_name_or_path}' has {size} tokens "
            f"but the model '{model.name_or_path}' has {rows} embedding rows (vocab_size): ids "
            f"from {rows} on have no embedding; use the model's own tokenizer "
            "(model.tokenizer_name_or_path: null), or name the new tokens in "
            "model.added_tokens so the embeddings grow to the tokenizer's size")


def _check_targets(cfg: FinetuneConfig, model_config) -> None:
    from engine.modeling.adapter import check_target_modules, check_target_parameters
    from engine.modeling.model import model_class

    klass = model_class(cfg.model.auto_class_name)
    if not hasattr(klass, "from_config"):  # a project's own class: built its own way
        return
    if cfg.data.targets == "labels":  # a class head of any size: only module names matter
        model_config.num_labels = len(cfg.data.labels or ()) or 2
    with torch.device("meta"):
        skeleton = klass.from_config(model_config)
    check_target_modules(skeleton, cfg.peft.target_modules)
    check_target_parameters(skeleton, cfg.peft.target_parameters)


def check_resume_target(cfg: FinetuneConfig, root: Path, checkpoints: Path) -> None:
    """`finetune validate`'s resume check: a named checkpoint exists whole, and this strategy
    and world size can continue it with its global batch; with resume_from_checkpoint: true,
    the newest one in `checkpoints` (meta.json alone, no file hashing)."""
    from engine.state.trainer_state import resumable_path

    mode = cfg.checkpoint.resume_from_checkpoint
    if isinstance(mode, str) and mode != "auto":
        check_global_batch(cfg, *resumable_path(mode, root, cfg.distributed))
    elif mode is True:
        check_world_size(cfg, checkpoints)


def check_before_launch(cfg: FinetuneConfig, paths: RunPaths) -> None:
    """What the worker would refuse, asked first: user code and the machine, a user collate
    function on two real rows, and (when resuming) the checkpoint the worker would continue
    (its fingerprint hashes are cached for the worker). Rank 0 writes nothing until this
    passed (tasks/launch.py)."""
    check_user_code_and_machine(cfg, device_for(cfg))
    check_rollout_server(cfg)
    if cfg.logging.profiler.enabled:
        check_traces_dir(cfg.logging, paths.project_root, (paths.trained, paths.checkpoints))
    if paths.train_data is not None:
        if not paths.train_data.exists():
            raise PipelineError(f"{paths.train_data} missing; run the tokenize stage")
        ref = cfg.data.user_collate_fn
        if ref:
            from engine.datapath.data import check_collate, load_tokenized, take_rows, user_collate

            rows = take_rows(load_tokenized(paths.train_data), range(2))
            check_collate(user_collate(ref), rows, ref)
    if cfg.checkpoint.resume_from_checkpoint:
        from engine.state import fingerprint
        from engine.state.trainer_state import plan_start

        plan_start(paths.checkpoints, lambda: fingerprint.of_run(cfg, paths), cfg.checkpoint,
                   cfg.distributed, log=lambda line: None, root=paths.project_root)


def check_rollout_server(cfg: FinetuneConfig) -> None:
    """A rollout method with use_vllm: its vLLM server answers `/v1/models` within
    vllm_server_timeout seconds, or one line naming the key and the URL before any process
    starts (the worker waits for it the same way: engine.rollout.vllm_server)."""
    from finetune.config.rollout import ROLLOUT_SECTIONS, rollout_section

    kind = cfg.training.type
    if kind not in ROLLOUT_SECTIONS and ":" not in kind:
        return
    g = rollout_section(cfg)
    if not g.use_vllm:
        return
    from engine.rollout.vllm_server import served_models

    served_models(g.vllm_server_base_url, f"{g.SCOPE}.vllm_server_base_url",
                  g.vllm_server_timeout)


def check_world_size(cfg: FinetuneConfig, checkpoints: Path) -> None:
    """Before any process starts: a resume of the newest checkpoint that this strategy and
    world size cannot continue (DiLoCo or pipeline on another world size, another strategy
    family) is refused from its meta.json alone (no file hashing)."""
    from engine.state import checkpoint as ckpt
    from engine.state.trainer_state import check_resumable

    newest = ckpt.newest_meta(checkpoints)
    if newest is not None:
        check_resumable(newest[1], newest[0], cfg.distributed)
        check_global_batch(cfg, newest[0], newest[1])


def check_global_batch(cfg: FinetuneConfig, path: Path, meta: dict) -> None:
    """From meta.json alone: a resume must keep the checkpoint's examples per optimizer step
    (on any world size); the same one-line refusal as the worker's full fingerprint check."""
    from engine.state.fingerprint import global_batch_refusal
    from finetune.config.fingerprint import GLOBAL_BATCH, batch_split, global_batch

    if GLOBAL_BATCH in cfg.checkpoint.resume_ignore_changes:
        return
    line = global_batch_refusal(path, meta.get("fingerprint") or {},
                                {"config": {GLOBAL_BATCH: global_batch(cfg)},
                                 "batch": batch_split(cfg)})
    if line is not None:
        raise PipelineError(line)


def seed_of_resumed_checkpoint(cfg: FinetuneConfig, paths: RunPaths) -> int | None:
    """`training.seed: null` and a resume: the seed of the checkpoint the resume would pick
    (the same choice as plan_start's), so data order and dropout continue and the fingerprint
    matches; None when there is none to continue."""
    from engine.state import checkpoint as ckpt
    from engine.state.trainer_state import resume_candidate

    path = resume_candidate(cfg.checkpoint.resume_from_checkpoint, paths.checkpoints,
                            paths.project_root)
    meta = ckpt.read_meta(path) if path is not None and path.is_dir() else None
    return (meta or {}).get("seed")


def newest_checkpoint(checkpoints: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint and its meta record, or None."""
    from engine.state.checkpoint import newest_meta

    return newest_meta(checkpoints)


def checkpoint_of_this_run(cfg: FinetuneConfig, paths: RunPaths) -> tuple[Path, dict] | None:
    """The newest checkpoint if `resume_from_checkpoint: true` with these params would
    continue it (its fingerprint matches, under a strategy and world size that can resume
    it), else None: what an interrupted stage points the user to. An earlier run's checkpoint
    stays in the folder until this run saves its first one, so the newest is not always this
    run's. A null
    training.seed was drawn by the stage, so the seed is not compared."""
    from engine.state import fingerprint
    from engine.state.trainer_state import belongs_to_run, resumable_shape

    newest = newest_checkpoint(paths.checkpoints)
    if newest is None:
        return None
    path, meta = newest
    same_shape = resumable_shape(meta, cfg.distributed)
    unseeded = ("training.seed",) if cfg.training.seed is None else ()
    if same_shape and belongs_to_run(meta, lambda: fingerprint.of_run(cfg, paths),
                                     cfg.checkpoint, ignore=unseeded):
        return newest
    return None
