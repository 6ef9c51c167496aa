"""The formats the export stage writes (export.formats), one module each, and their registry.

Each module has an `Exporter` (tasks/exporters/base.py) that owns the format's lifecycle: its
check at validate time, its preflight before any format writes, `write(ctx)` (its files under
`ctx.staging`, the export folder being built and moved into place when all are written; None
when the format does not apply to the run), its model-card section and its MLflow tags. A new
format is one module here and one line in `EXPORTERS`; `finetune.config.export.EXPORT_FORMATS`
(export.formats' default) lists the same names, in the same order (a test ties them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from finetune.config.section import did_you_mean
from finetune.errors import PipelineError
from tasks.exporters.adapter import AdapterExporter
from tasks.exporters.base import Exporter
from tasks.exporters.context import ExportContext
from tasks.exporters.gguf import GGUFExporter
from tasks.exporters.hf import HFExporter
from tasks.exporters.quantized import QuantizedExporter

#: name (as export.formats lists it) -> its exporter, in the order they are written: hf
#: first, the folder the others sit in
EXPORTERS: dict[str, Exporter] = {
    "hf": HFExporter(),
    "adapter": AdapterExporter(),
    "quantized": QuantizedExporter(),
    "gguf": GGUFExporter(),
}


def resolve(formats: Sequence[str]) -> list[Exporter]:
    """export.formats -> the exporters to run, in EXPORTERS' order; one line for a name no
    exporter has (`finetune validate` and the export stage both ask, before any work)."""
    for name in formats:
        if name not in EXPORTERS:
            raise PipelineError(f"export.formats: unknown format '{name}'"
                                f"{did_you_mean(name, EXPORTERS)}: one of "
                                f"{', '.join(EXPORTERS)}")
    return [exporter for name, exporter in EXPORTERS.items() if name in formats]


def check(ws, formats: Sequence[str]) -> None:
    """`finetune validate`: the listed names known, and every exporter's check of its keys."""
    resolve(formats)
    for exporter in EXPORTERS.values():
        exporter.check(ws)


def preflight(ctx: ExportContext) -> None:
    """Each listed format's refusals, before any format writes a file: a refused export
    costs no half-built folder and says why at once."""
    for exporter in resolve(ctx.formats):
        exporter.preflight(ctx)


def tags(formats: Sequence[str], export_dir: Path) -> dict[str, str]:
    """What the listed formats wrote in the finished export folder, as MLflow tags."""
    return {k: v for exporter in resolve(formats) for k, v in exporter.tags(export_dir).items()}


__all__ = ["EXPORTERS", "ExportContext", "Exporter", "check", "preflight", "resolve", "tags"]
