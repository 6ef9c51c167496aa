"""Render the params reference (every key: type, default, meaning) from the schema.

`finetune reference` prints it; README.md embeds it between markers and a test fails when the
two drift apart, so the documentation cannot go stale.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from finetune.config.schema import FinetuneConfig

BEGIN = "<!-- params-reference:begin -->"
END = "<!-- params-reference:end -->"


def _type_name(annotation) -> str:
    text = str(annotation)
    if isinstance(annotation, type):
        text = annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "None")
    if typing.get_origin(annotation) is typing.Literal:
        text = " | ".join(repr(a) for a in typing.get_args(annotation))
    return text.replace("|", "\\|")


def render() -> str:
    lines = []
    for section, field in FinetuneConfig.model_fields.items():
        model: type[BaseModel] = field.annotation
        lines.append(f"\n### `{section}`\n\n{(model.__doc__ or '').strip()}\n")
        lines.append("| key | type | default | meaning |\n|---|---|---|---|")
        for name, f in model.model_fields.items():
            default = f.default_factory() if f.default_factory else f.default
            shown = json.dumps(default).replace("|", "\\|")
            lines.append(f"| `{section}.{name}` | {_type_name(f.annotation)} | `{shown}` | "
                         f"{f.description or ''} |")
    return "\n".join(lines).strip() + "\n"


def embed(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{render()}{END}{tail}"
