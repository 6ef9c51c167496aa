"""`Exporter`: one export format's whole lifecycle, so `finetune validate`, the export stage and
the model card ask every format the same questions and name none of them.

A format must define `write`; every other member does nothing unless it overrides it:

- `check(ws)`: what the params and the base model's config alone can refuse, at validate time
  (before any stage runs). Asked of every registered format, listed or not: each checks its
  own keys (export.gguf's types are refused even where export.formats leaves gguf out);
- `preflight(ctx)`: in the export stage, what it can refuse with the trained model at hand,
  asked of every listed format before any of them writes a file;
- `write(ctx)`: its files under `ctx.staging`; what it wrote, or None where it does not apply;
- `card_section(ctx, export_dir)`: its part of the model card (how to load what it wrote);
- `tags(export_dir)`: what the training's MLflow run and the registered version record of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from tasks.exporters.context import ExportContext


class Exporter(ABC):
    name: str = ""

    def check(self, ws) -> None:
        """At validate time: one line for what the params alone can refuse."""

    def preflight(self, ctx: ExportContext) -> None:
        """In the export stage, before any format writes: one line for what it refuses."""

    @abstractmethod
    def write(self, ctx: ExportContext) -> Path | None:
        """Its files under `ctx.staging`: what it wrote, or None where it does not apply."""

    def card_section(self, ctx: ExportContext, export_dir: Path) -> str:
        """Markdown for the model card ('' for none); `export_dir` as the card names it."""
        return ""

    def tags(self, export_dir: Path) -> dict[str, str]:
        """MLflow tags of what it wrote in the finished export folder."""
        return {}
