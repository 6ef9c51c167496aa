"""Rules that span sections of a params file, one function per strategy or data mode.

Called by FinetuneConfig's validator (finetune/config/schema.py) with the whole config; each
raises ValueError with one line naming the keys, which the loader reports with the file.
"""

from __future__ import annotations

from finetune.config.pipeline import ZERO_BUBBLE


def check_pipeline(cfg) -> None:
    """Seed 002's pipeline rules, and what a pipeline's fixed-shape stages cannot take."""
    t, pp = cfg.training, cfg.distributed.pipeline
    n = pp.microbatches(cfg.distributed.world_size)
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(t, key) % n:
            raise ValueError(f"distributed.pipeline: training.{key} {getattr(t, key)} does "
                             f"not divide into n_microbatches {n}")
    refused = (
        ("training.dataloader_drop_last", not t.dataloader_drop_last,
         "every pipeline step needs whole batches"),
        ("training.mixed_precision", t.mixed_precision == "fp16",
         "fp16's loss scaling does not run through the pipeline schedules; use bf16"),
        ("training.torch_compile", t.torch_compile and pp.schedule in ZERO_BUBBLE,
         "zero-bubble schedules split the backward, which compiled stages cannot"),
        ("training.packing", t.packing, "stages pass fixed-shape activations"),
        ("training.padding_free", t.padding_free, "stages pass fixed-shape activations"),
        ("data.collate_fn", bool(cfg.data.collate_fn),
         "the pipeline pads every batch to data.max_seq_length itself"),
        ("data.dataset_type", cfg.data.task.classifier,
         "the stages are a causal LM's decoder layers and head"),
        ("data.streaming", cfg.data.streaming, "not supported with pipeline stages yet"),
    )
    for key, hit, why in refused:
        if hit:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            raise ValueError(f"distributed.strategy pipeline does not combine with {key}: "
                             f"{value} ({why})")


def check_streaming(cfg) -> None:
    """A stream has no length and cannot be indexed: what needs either is refused, unless
    training.epoch_train_steps gives it a nominal epoch."""
    t = cfg.training
    nominal = t.epoch_train_steps is not None
    if t.max_steps <= 0 and not nominal:
        raise ValueError("data.streaming: a stream has no length, so epochs cannot size the "
                         "run; set training.max_steps > 0 (or training.epoch_train_steps)")
    refused = (
        ("training.group_by_length", t.group_by_length, "needs every example's length"),
        ("training.dataloader_num_workers", t.dataloader_num_workers,
         "streamed batches are built in the main process"),
        ("training.dataloader_drop_last", not t.dataloader_drop_last,
         "false refills from the epoch start, which a stream cannot revisit"),
        ("eval.eval_strategy", cfg.eval.eval_strategy == "epoch" and not nominal,
         "epoch ends are unknown; set training.epoch_train_steps"),
        ("checkpoint.save_strategy", cfg.checkpoint.save_strategy == "epoch" and not nominal,
         "epoch ends are unknown; set training.epoch_train_steps"),
    )
    for key, hit, why in refused:
        if hit:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            raise ValueError(f"data.streaming does not combine with {key}: {value} ({why})")


def check_diloco(cfg) -> None:
    """H = distributed.diloco.inner_steps; a worker trains H x diloco_loops steps, which
    training.max_steps may state too (it keeps its one meaning). Evaluation and
    checkpoints happen at sync points, where every worker holds the global model."""
    diloco = cfg.distributed.diloco
    h, total = diloco.inner_steps, diloco.inner_steps * diloco.diloco_loops
    if cfg.training.max_steps > 0 and cfg.training.max_steps != total:
        raise ValueError(
            f"training.max_steps {cfg.training.max_steps} != distributed.diloco.inner_steps "
            f"{h} x diloco_loops {diloco.diloco_loops} = {total} (a worker's total optimizer "
            "steps); fix one of them, or set training.max_steps: -1"
        )
    for key, value in (("eval.eval_strategy", cfg.eval.eval_strategy),
                       ("checkpoint.save_strategy", cfg.checkpoint.save_strategy)):
        if value == "epoch":
            raise ValueError(f"{key} epoch is not supported under diloco (epoch ends are "
                             "not sync points); use steps with a multiple of H")
    if cfg.eval.eval_strategy == "steps" and cfg.eval.eval_steps % h:
        raise ValueError(
            f"eval.eval_steps {cfg.eval.eval_steps} must be a multiple of "
            f"distributed.diloco.inner_steps {h} under diloco (evaluate the global model, "
            "at an outer-loop end)"
        )
    if cfg.checkpoint.save_strategy == "steps" and cfg.checkpoint.save_steps % h:
        raise ValueError(
            f"checkpoint.save_steps {cfg.checkpoint.save_steps} must be a multiple of "
            f"distributed.diloco.inner_steps {h} under diloco (checkpoints are taken at "
            "sync points)"
        )
    start = diloco.local_sgd_start_step
    if start % h:
        raise ValueError(
            f"distributed.diloco.local_sgd_start_step {start} must be a multiple of "
            f"distributed.diloco.inner_steps {h} (outer syncs fall on multiples of H)"
        )
    if start >= total:
        raise ValueError(
            f"distributed.diloco.local_sgd_start_step {start} >= total steps {total}: "
            "the run would never go local"
        )


def check_meta_construction(cfg) -> None:
    """training.construct_model_on meta reads stored weights into a skeleton: what needs the
    weights while the model is built, or builds it another way, is refused."""
    m, t = cfg.model, cfg.training
    refused = (
        ("model.model_init", bool(m.model_init), "the factory builds the model itself"),
        ("model.load_in_4bit", m.load_in_4bit, "quantised loading is from_pretrained's"),
        ("model.load_in_8bit", m.load_in_8bit, "quantised loading is from_pretrained's"),
        ("model.device_map", bool(m.device_map), "the strategy places the weights"),
        ("model.added_tokens", bool(m.added_tokens or m.special_tokens),
         "new embedding rows are the mean of the stored ones"),
        ("data.dataset_type", cfg.data.task.classifier,
         "a new classification head is initialised, not read"),
        ("training.qat_recipe", bool(t.qat_recipe), "QAT swaps the layers being built"),
        ("distributed.diloco.fsdp_group_size",
         cfg.distributed.diloco is not None and cfg.distributed.diloco.fsdp_group_size > 1,
         "DiLoCo copies the sharded weights before the shards are read"),
    )
    for key, hit, why in refused:
        if hit:
            raise ValueError(f"training.construct_model_on meta does not combine with {key} "
                             f"({why}); use construct_model_on: default or device")
