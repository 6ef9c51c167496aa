"""Keys users bring from HF's TrainingArguments, TRL and Axolotl that this project names
otherwise or has no use for: what an unknown key's one line says instead of guessing by
spelling (`finetune.config.loader.explain`). Spelling alone suggests the wrong key for these
(`data.dataset_subset` -> `data.dataset_type`, `training.output_dir` ->
`logging.profiler.output_dir`, `checkpoint.save_safetensors` -> `checkpoint.save_steps`), so a
known name is answered by meaning: our key where there is one, else why none is needed.

Each reason states what the project does, as checked in its code: keep them true when that
changes (tests/test_config.py reads every entry back through the loader).
"""

from __future__ import annotations

#: foreign key name -> our dotted key (a rename), wherever in the file it is written
RENAMED = {
    "dataset_subset": "data.subset",
    "dataset_config_name": "data.subset",
    "fsdp_config": "distributed.fsdp",
    "fsdp": "distributed.strategy",
    "freeze_vision_tower": "model.freeze_vision_tower",
    "freeze_vit": "model.freeze_vision_tower",
    "freeze_multi_modal_projector": "model.freeze_projector",
    "freeze_aligner": "model.freeze_projector",
}

#: foreign key name -> why this project has no such key (the one line's reason)
NOT_NEEDED = {
    "output_dir": "each stage writes to the folders dvc.yaml names (data/checkpoints, "
    "data/trained, data/export)",
    "overwrite_output_dir": "a stage's outputs are written anew on every run (DVC removes "
    "them first); to continue a run set checkpoint.resume_from_checkpoint",
    "save_safetensors": "the trained model and the export are always written as safetensors",
    "dispatch_batches": "every process reads its own shard of each batch (no rank dispatches "
    "batches to the others)",
    "average_tokens_across_devices": "the loss is always normalised by the target tokens of "
    "all processes together",
    "set_dataset_epoch": "every epoch reshuffles on its own, streamed splits included",
    "accelerator_config": "there is no Accelerate here: the distributed section sets the "
    "processes and their strategy",
}


def foreign(name: str) -> str | None:
    """The hint for an unknown key called `name`: "did you mean 'KEY'?" for a rename, the
    reason for one this project does without, or None for a name it does not know."""
    if name in RENAMED:
        return f"did you mean '{RENAMED[name]}'?"
    if name in NOT_NEEDED:
        return f"HF's {name} has no key here: {NOT_NEEDED[name]}"
    return None
