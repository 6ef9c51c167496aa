"""`quantized`: the QAT model converted (training.qat_recipe), in `<export>/quantized`.

`engine.modeling.quantization.load_quantized(folder)` loads it; written only for runs that
trained with a QAT recipe.
"""

from __future__ import annotations

from pathlib import Path

from engine.export import check_convertible, quantized_copy, save_quantized
from tasks.exporters.base import Exporter
from tasks.exporters.context import ExportContext

QUANTIZED_DIR = "quantized"


def write(ctx: ExportContext) -> Path | None:
    t = ctx.config.training
    if not t.qat_recipe:
        return None
    check_convertible(t.qat_recipe, t.qat_group_size, next(ctx.hf_model.parameters()).device)
    # a converted copy of the HF folder's model (quantized_copy merges an unmerged adapter)
    quantized, skipped = quantized_copy(ctx.hf_model, t.qat_recipe, t.qat_group_size)
    save_quantized(quantized, ctx.staging / QUANTIZED_DIR, t.qat_recipe, t.qat_group_size,
                   skipped)
    del quantized
    return ctx.staging / QUANTIZED_DIR


class QuantizedExporter(Exporter):
    name = "quantized"

    def write(self, ctx: ExportContext) -> Path | None:
        return write(ctx)
