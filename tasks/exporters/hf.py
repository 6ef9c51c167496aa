"""`hf`: the self-contained Hugging Face folder at the export root.

It loads with `from_pretrained` and nothing else: safetensors weights (the adapter merged when
peft.use_peft and export.merge_adapter; unmerged, the adapter as trained), the tokenizer,
labels.json (classification), the generation config and the model card (README.md, which the
export stage writes once every format is written: it lists what they wrote). The other
formats' folders sit inside it, and the registry logs its model and card, so it is always
written (export.formats must list it).
"""

from __future__ import annotations

from pathlib import Path

from engine.export import load_processor, read_labels, write_labels
from tasks.exporters.base import Exporter
from tasks.exporters.context import ExportContext


def write(ctx: ExportContext) -> Path:
    model, staging = ctx.hf_model, ctx.staging
    model.save_pretrained(staging, safe_serialization=True,
                          max_shard_size=ctx.config.export.max_shard_size)
    # the processor: the tokenizer, or a vision-language model's processor around it
    load_processor(ctx.config, ctx.tokenizer, ctx.ws.root).save_pretrained(staging)
    labels = read_labels(ctx.ws.layout.trained)
    if labels:  # also in config.json (id2label); the file is what our stages read
        write_labels(staging, labels)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    return staging


class HFExporter(Exporter):
    name = "hf"

    def write(self, ctx: ExportContext) -> Path:
        return write(ctx)
