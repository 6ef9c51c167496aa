"""Render the params reference (every key: type, default, meaning, where it applies) from the
schema and the compatibility table (finetune/config/compat.py).

`finetune reference` prints it; the docs site's reference page (docs/reference.md) embeds it
between markers (`finetune reference --write` updates it) and tests/test_docs.py fails when the
two drift apart, so the documentation cannot go stale.
"""

from __future__ import annotations

import json
import types
import typing

from pydantic import BaseModel

from finetune.config.compat import applies_to
from finetune.config.schema import FinetuneConfig
from finetune.config.section import section_model

BEGIN = "<!-- params-reference:begin -->"
END = "<!-- params-reference:end -->"


def _type_name(annotation, escape: bool = True) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        text = " | ".join(_type_name(a, escape=False) for a in args)
        return text.replace("|", "\\|") if escape else text
    text = str(annotation)
    if isinstance(annotation, type):
        text = annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "None")
    if typing.get_origin(annotation) is typing.Literal:
        text = " | ".join(repr(a) for a in typing.get_args(annotation))
    return text.replace("|", "\\|") if escape else text


def _list_item_section(annotation) -> type[BaseModel] | None:
    """`X` of a `list[X]` (or `list[X] | None`) field whose X is a section."""
    for candidate in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(candidate) is list:
            return section_model(typing.get_args(candidate)[0])
    return None


def _render_section(prefix: str, model: type[BaseModel], lines: list[str]) -> None:
    """One table per section; optional sub-sections (e.g. distributed.fsdp) get their own."""
    doc = " ".join((model.__doc__ or "").split())
    lines.append(f"\n## `{prefix}`\n\n{doc}\n")
    lines.append("| key | type | default | meaning | applies to |\n|---|---|---|---|---|")
    nested = []
    for name, f in model.model_fields.items():
        item = _list_item_section(f.annotation)
        if item is not None:  # a list of sections (data.sources): one table for an item
            nested.append((f"{prefix}.{name}[]", item))
            lines.append(f"| `{prefix}.{name}` | list of sections or None | `null` | "
                         f"{f.description or ''} (item keys below) | {_where(prefix, name)} |")
            continue
        sub = section_model(f.annotation)
        if sub is not None:
            nested.append((f"{prefix}.{name}", sub))
            kind, shown = ("section or None", "null") if f.default is None else ("section", "{}")
            lines.append(f"| `{prefix}.{name}` | {kind} | `{shown}` | {f.description or ''} "
                         f"(keys below) | {_where(prefix, name)} |")
            continue
        if f.is_required():
            shown = "required"
        else:
            default = f.default_factory() if f.default_factory else f.default
            shown = json.dumps(default).replace("|", "\\|")
        lines.append(f"| `{prefix}.{name}` | {_type_name(f.annotation)} | `{shown}` | "
                     f"{f.description or ''} | {_where(prefix, name)} |")
    for sub_prefix, sub in nested:
        _render_section(sub_prefix, sub, lines)


def _where(prefix: str, name: str) -> str:
    """Where the key does not apply, from the compatibility table (empty: everywhere)."""
    dotted = f"{prefix}.{name}".replace("[]", "")
    return applies_to(dotted).replace("|", "\\|") or "all"


def render() -> str:
    lines: list[str] = []
    for section, field in FinetuneConfig.model_fields.items():
        _render_section(section, section_model(field.annotation), lines)
    return "\n".join(lines).strip() + "\n"


def embed(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{render()}{END}{tail}"
