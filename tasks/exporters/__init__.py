"""The formats the export stage writes (export.formats), one module each, and their registry.

Each module has `write(ctx: ExportContext) -> Path | None`: it writes its format under
`ctx.staging` (the export folder being built, moved into place when all are written) and
returns what it wrote, or None when the format does not apply to the run (the adapter alone of
a run without one). A new format is one module here and one line in `EXPORTERS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from finetune.config.section import did_you_mean
from finetune.errors import PipelineError
from tasks.exporters import adapter, gguf, hf, quantized
from tasks.exporters.context import ExportContext

Exporter = Callable[[ExportContext], Path | None]

#: name (as export.formats lists it) -> its write function, in the order they are written:
#: hf first, the folder the others sit in
EXPORTERS: dict[str, Exporter] = {
    "hf": hf.write,
    "adapter": adapter.write,
    "quantized": quantized.write,
    "gguf": gguf.write,
}

#: name -> what it refuses, checked for every listed format before any writes
PREFLIGHTS: dict[str, Callable[[ExportContext], None]] = {"gguf": gguf.preflight}


def preflight(ctx: ExportContext) -> None:
    """Each listed format's refusals, before any format writes a file: a refused export
    costs no half-built folder and says why at once."""
    for name in ctx.formats:
        if name in PREFLIGHTS:
            PREFLIGHTS[name](ctx)


def resolve(formats: Sequence[str]) -> list[Exporter]:
    """export.formats -> the write functions to call, in EXPORTERS' order; one line for a name
    no exporter has (`finetune validate` and the export stage both ask, before any work)."""
    for name in formats:
        if name not in EXPORTERS:
            raise PipelineError(f"export.formats: unknown format '{name}'"
                                f"{did_you_mean(name, EXPORTERS)}: one of "
                                f"{', '.join(EXPORTERS)}")
    return [write for name, write in EXPORTERS.items() if name in formats]


__all__ = ["EXPORTERS", "ExportContext", "Exporter", "preflight", "resolve"]
