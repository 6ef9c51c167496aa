"""Every check that needs no data: what `finetune validate` (dvc.yaml's first stage) runs
beyond the schema, so bad input fails before DVC runs (and clears the outputs of) any stage.

What the config alone cannot tell comes from what is cheap to read: the machine (the device a
run would get), the model's config.json and its module names (a skeleton on the meta device,
no weights), the tokenizer files, the first row of each data file (its columns; a file is
never read whole, but for one column where the method names an environment per row: every
row's `environment`, so a row naming none of grpo.environment_factory's fails here, not in
the format stage after download), the functions and template files the params name, and a checkpoint's
meta.json. The train stage runs the same checks of user code and the machine before it
launches (`user_code_and_machine`), and its own data-dependent ones after.
"""

from __future__ import annotations

from finetune.errors import PipelineError
from finetune.workspace import Workspace


def check_without_data(ws: Workspace) -> None:
    """One line for the first problem found; nothing is written."""
    from engine.preflight import device_for

    user_code_and_machine(ws, device_for(ws.config))
    check_model(ws)
    check_resume_target(ws)
    check_sources(ws)
    check_harness(ws)
    check_export_formats(ws)
    check_model_refs(ws)


def check_model_refs(ws: Workspace) -> None:
    """The trained models the params name (keys marked `model_ref`): each folder holds what its
    key needs (a reward model: a one-output sequence classifier with its tokenizer), each
    registered model is in the registry (tasks.model_refs)."""
    from tasks import model_refs

    model_refs.check(ws)


def check_export_formats(ws: Workspace) -> None:
    """export.formats: every name is an exporter's (tasks.exporters, which the export stage
    runs), and each exporter's own check of its keys (export.gguf: every type is one the GGUF
    exporter encodes, in which the model's architecture and tensors can be written)."""
    from tasks import exporters

    exporters.check(ws, ws.config.export.formats)


def environment_names(cfg) -> list[str] | None:
    """The names a row's `environment` column chooses from: the keys of the method's
    environments when they are a mapping (grpo.environment_factory as {name: class}), else
    None (one environment, or none: rows name nothing)."""
    from finetune.config.methods import method_of

    method = method_of(cfg.training.type)
    named = method.prompt_environments(cfg) if method.prompt_environments else None
    return list(named) if isinstance(named, dict) else None


def check_environment_column(values: list | None, split: str, names: list[str]) -> None:
    """Every row of a split names one of `names` in its `environment` column (`values`, None
    without the column): the format stage's one line, before any stage runs."""
    import pandas as pd

    from finetune.datatypes.chat import ENVIRONMENT_COLUMN, per_row_environment_tools

    frame = pd.DataFrame({} if values is None else {ENVIRONMENT_COLUMN: values})
    per_row_environment_tools(frame, dict.fromkeys(names, []), split)


def check_length_column(training, datatype, first: dict, ctx) -> None:
    """group_by_length's column must be one the tokenize stage writes: the first train row is
    formatted and encoded as the stages will (the tokenizer is loaded only for a column other
    than `length`, which the stage always writes), so a misspelt name fails here, not in the
    train stage after download, format and tokenize."""
    if not training.group_by_length or training.length_column_name == "length":
        return
    import pandas as pd

    formatted = datatype.format(pd.DataFrame([first]), "train", ctx, 0)
    fn, kwargs = datatype.encoder(ctx)
    columns = [*fn(formatted.rows.to_dict("list"), tok=ctx.tokenizer, **kwargs), "length"]
    if training.length_column_name not in columns:
        raise PipelineError(f"training.length_column_name '{training.length_column_name}' is "
                            "not a column of the tokenized train split (columns: "
                            f"{', '.join(columns)})")


def check_harness(ws: Workspace) -> None:
    """eval.harness: lm-eval installed, every task file found and every task name known
    (tasks.harness, which the evaluate stage runs)."""
    harness = ws.config.eval.harness
    if harness.tasks:
        from tasks.harness import resolve_tasks

        resolve_tasks(harness.tasks, ws.root)


def user_code_and_machine(ws: Workspace, device) -> None:
    """The engine's checks of the classes and functions the params name and of the machine
    (engine.preflight: the train stage runs them too), and W&B when it reports there."""
    from engine.preflight import check_user_code_and_machine

    check_user_code_and_machine(ws.config, device)
    if "wandb" in ws.config.logging.report_to:
        from tasks.wandb_tracking import wandb_module

        wandb_module()


def check_model(ws: Workspace) -> None:
    """The model folder (or hub id, offline) has a config of the kind the dataset trains;
    data.max_seq_length fits its positions; a tokenizer of its own fits its embeddings; the
    adapter's target modules exist (engine.preflight.check_model: a weightless skeleton on the
    meta device). The tokenizer is the data stages' to load (a chat type's template check
    loads it here)."""
    from engine.preflight import check_model as check

    check(ws.config, ws.root)


def check_resume_target(ws: Workspace) -> None:
    """A named checkpoint exists whole, and this strategy and world size can continue it with
    its global batch; with resume_from_checkpoint: true, the newest one (meta.json alone, no
    file hashing: engine.preflight.check_resume_target)."""
    from engine.preflight import check_resume_target as check

    check(ws.config, ws.root, ws.layout.checkpoints)


def check_sources(ws: Workspace) -> None:
    """For each local source: its files exist, the splits it names are there (a missing test
    split only where it can be carved), the first row of each split has the columns its
    dataset type reads, and the type's functions and template files load. A hub dataset is
    the download stage's to reach."""
    from finetune.datatypes import DataContext
    from tasks.download import check_split_names
    from tasks.format import data_context
    from finetune.datatypes.chat import ENVIRONMENT_COLUMN
    from tasks.stream import (column_values, first_rows, local_dataset, local_files,
                              open_source, split_name)

    top = ws.config.data
    ctx: DataContext = data_context(ws)
    environments = environment_names(ws.config)
    for name, data in top.parts():
        data.datatype.prepare(ctx)
        if data.dataset_name and local_dataset(data, ws.root) is None:
            continue
        splits = open_source(data, ws.root)  # one line for a missing file or an odd extension
        label = f"source '{name}'" if name else "data"
        check_split_names(data, list(splits), eval_only=top.eval_only(name))
        required = data.datatype.required_columns()
        files = local_files(data, ws.root)
        for split, rows in splits.items():
            first = next(iter(first_rows(rows, 1, files.get(split))), None)
            if first is None:
                raise PipelineError(f"{label} split '{split}': no rows")
            missing = [c for c in required if c not in first]
            if missing:
                raise PipelineError(
                    f"{label} split '{split}': column '{missing[0]}' that "
                    f"data.dataset_type {data.dataset_type} reads is missing (columns: "
                    f"{', '.join(map(str, first))})")
            if environments:
                check_environment_column(
                    column_values(rows, ENVIRONMENT_COLUMN, files.get(split)), split, environments)
            if split == split_name(data.train_split) and not top.eval_only(name):
                check_length_column(ws.config.training, data.datatype, first, ctx)
