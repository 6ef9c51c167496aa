"""Read a params file, apply overrides (finetune.config.overrides), validate, explain errors.

Every failure becomes a `PipelineError` with one line: the file, the dotted key, what is wrong and
(for unknown keys) the closest valid name.
"""

from __future__ import annotations

import difflib
import re
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ValidationError

from finetune.config.foreign import foreign
from finetune.config.overrides import apply_overrides
from finetune.config.schema import FinetuneConfig
from finetune.config.section import did_you_mean, dotted_keys, section_model
from finetune.errors import PipelineError
from finetune.imports import project_files


def project_root_for(params_path: Path) -> Path:
    """The folder relative paths in a params file resolve against.

    It is the nearest ancestor of the params file holding `dvc.yaml` or `pyproject.toml`, so a
    stage launched from any cwd (a Prefect worker, a test) reads and writes the same files.
    """
    params_path = params_path.resolve()
    for folder in params_path.parents:
        if (folder / "dvc.yaml").exists() or (folder / "pyproject.toml").exists():
            return folder
    return params_path.parent


def set_keys(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each dotted key set to its (already typed) value, sections created
    as needed: how code writes params (tests, benchmarks, the flow's dict of overrides). The
    command line's `-s` strings go through finetune.config.overrides, DVC's rules."""
    merged = json.loads(json.dumps(raw))
    for dotted, value in values.items():
        node = merged
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise PipelineError(f"override '{dotted}': '{part}' is not a section")
            node = child
        node[leaf] = value
    return merged


def read_params_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise PipelineError(f"{path}: params file not found")
    text = path.read_text()
    if not text.strip():  # an empty file would fail on its first required key: say what it is
        raise PipelineError(f"{path}: the params file is empty; restore it (git checkout "
                            f"{path}) or start from the repository's params/default.yaml")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise PipelineError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})")
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: top level must be a mapping of sections")
    _not_a_deployment_file(path, raw)
    return raw


def _not_a_deployment_file(path: Path, raw: dict[str, Any]) -> None:
    """params/deployment.yaml sits beside the params files but is the Prefect deployment's
    settings (flows/deploy.py): passed as a params file, it used to fail on its first missing
    section, which did not say what the file is."""
    if "params_file" in raw and not raw.keys() & FinetuneConfig.model_fields.keys():
        runs = raw["params_file"] if isinstance(raw["params_file"], str) else None
        instead = f"pass the params file it runs: -p {runs}" if runs else (
            "pass a params file, e.g. -p params/default.yaml")
        raise PipelineError(f"{path}: this is a deployment file (the Prefect schedule "
                            f"finetune-stack reads: name, cron, params_file), not a params "
                            f"file; {instead}")


def load_config(
    path: str | Path, overrides: dict[str, Any] | list[str] | None = None
) -> FinetuneConfig:
    """Load and validate a params file; the only way the code gets a config. `overrides`:
    `-s` strings (DVC's syntax and rules) or a dict of dotted keys to values (set_keys)."""
    path = Path(path)
    raw = read_params_file(path)
    if isinstance(overrides, list):  # `-s` strings: as dvc exp run -S applies them
        raw = apply_overrides(raw, overrides, source=str(path), params_path=path)
    else:
        raw = set_keys(raw, overrides or {})
    with project_files(project_root_for(path)):  # 'path/to/file:Class' references
        return validate_raw(raw, source=str(path))


def validate_raw(raw: dict[str, Any], source: str = "<params>") -> FinetuneConfig:
    try:
        return FinetuneConfig.model_validate(raw)
    except ValidationError as exc:
        raise PipelineError(f"{source}: {explain(exc.errors()[0])}") from None


def explain(error: dict[str, Any]) -> str:
    """One pydantic error -> 'key: what is wrong (hint)'."""
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("function-after", "literal"))]
    # list items as the docs write them: registry.guard_metrics[0].max_drop
    key = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", ".".join(loc)) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        parent, name = loc[:-1], loc[-1]
        own = _alias_of(parent, name)
        if own:  # pydantic took the other name and left this one over
            dotted = ".".join(parent + [own])
            return (f"`{key}` is an alias of `{dotted}`, which the file also sets; keep one")
        where = f"in section '{'.'.join(parent)}'" if parent else "at the top level"
        known = foreign(str(name))  # a name from HF, TRL or Axolotl: answered by meaning
        if known:
            return f"unknown key '{key}' {where} ({known})"
        close = difflib.get_close_matches(name, _field_names(parent), n=1, cutoff=0.6)
        # the exact name in another section beats a near name in this one
        suggestion = _elsewhere(name, exact=True, near=parent) or (
            ".".join(parent + close) if close else _elsewhere(name))
        hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
        return f"unknown key '{key}' {where}{hint}"
    msg = error["msg"].removeprefix("Value error, ")
    if not loc:  # cross-section checks name their keys themselves
        return msg
    if kind == "literal_error" and isinstance(error.get("input"), str):  # one of a set
        choices = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
        msg += did_you_mean(error["input"], choices)
    if kind in ("missing",):
        return f"{key}: required key is missing"
    got = error.get("input")
    # a value is worth repeating; a whole section (a dict, or a model a section check got) is not
    shown = f" (got {got!r})" if got is not None and not isinstance(got, (dict, BaseModel)) else ""
    return f"{key}: {msg}{shown}"


def _all_keys() -> list[str]:
    """Every dotted key of the schema."""
    return dotted_keys(FinetuneConfig)


def all_keys() -> list[str]:
    return _all_keys()


def _elsewhere(name: str, exact: bool = False, near: list[str] | None = None) -> str | None:
    """A key HF users put in one section that lives in another (training.learning_rate ->
    optimizer.learning_rate): the same name anywhere, else (unless `exact`) the closest. Of
    several sections with the name, the one nearest to the section at `near` (the most
    section classes in common: rloo.loss_type -> grpo.loss_type, both rollout sections)."""
    keys = _all_keys()
    same = [k for k in keys if k.rsplit(".", 1)[-1] == name]
    if same and near:
        def shared(key: str) -> int:
            here, there = _section_at(near), _section_at(key.split(".")[:-1])
            if here is None or there is None:
                return 0
            return len(set(here.__mro__[1:]) & set(there.__mro__[1:]))
        same.sort(key=shared, reverse=True)  # stable: ties keep the schema's order
    if same or exact:
        return same[0] if same else None
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.8)
    return leaves[close[0]] if close else None


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    """The section class at a dotted location (list indices, as in data.sources.0, skipped)."""
    model: type[BaseModel] | None = FinetuneConfig
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part) if model else None
        model = section_model(field.annotation) if field else None
    return model


def _field_names(loc: list[str]) -> list[str]:
    model = _section_at(loc)
    return list(model.model_fields) if model else []


def _alias_of(loc: list[str], name: str) -> str | None:
    """The field of the section at `loc` that `name` is another name of (its validation
    aliases: QEfficient's target_column for label_column, ...), or None."""
    model = _section_at(loc)
    for field_name, field in (model.model_fields.items() if model else ()):
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        if field_name != name and name in choices:
            return field_name
    return None


def config_fingerprint(cfg: FinetuneConfig, sections: tuple[str, ...] | None = None) -> str:
    """Stable short hash of (some sections of) a config, for lineage and resume checks."""
    data = cfg.model_dump(mode="json")
    if sections:
        data = {k: data[k] for k in sections}
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
