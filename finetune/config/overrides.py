"""`-s` overrides, read and applied exactly as `dvc exp run -S` does them, with DVC's own parser.

DVC hands `-S [FILE:]KEY=VALUE` to Hydra's override grammar (`hydra.core.override_parser`) and
applies the result to the params file as an OmegaConf struct config (`dvc.utils.hydra`). Using
the same parser and the same struct rules here means one override means the same thing to
`finetune stage/config/validate -s`, to the Prefect flow's `overrides` and to
`dvc exp run -S params/default.yaml:...`:

- `training.max_steps=5` changes a key the params file has; `params/default.yaml:training.max_steps=5`
  names the file (DVC's form; without it DVC means `params.yaml`, which this project has not);
- `+section.key=1` adds a key the file lacks, `++section.key=1` adds or changes, `~section.key`
  deletes;
- values use Hydra's grammar: `3e-4` a float, `null`, `[a, b]`, `{k: v}`, `'quoted text'`.

Every refusal is one `PipelineError` line naming the override and the key.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from finetune.errors import PipelineError

SYNTAX = ("[FILE:]KEY=VALUE, +KEY=VALUE to add a key, ++KEY=VALUE to add or change, ~KEY to "
          "delete; as dvc exp run -S")


def split_file(text: str) -> tuple[str | None, str]:
    """`params/x.yaml:training.max_steps=5` -> ('params/x.yaml', 'training.max_steps=5'): a
    colon before the `=` names the file, as DVC's `to_path_overrides` reads it."""
    if ":" in text.partition("=")[0]:
        path, _, override = text.partition(":")
        return path, override
    return None, text


def check_file(named: str, params_path: Path, text: str) -> None:
    """An override that names a file must name the params file being loaded."""
    root_relative = [Path(named), Path.cwd() / named]
    root_relative += [folder / named for folder in params_path.resolve().parents]
    if not any(p.exists() and p.resolve() == params_path.resolve() for p in root_relative):
        raise PipelineError(f"override '{text}' names {named}, but the params file is "
                            f"{params_path}; name that file or leave the 'FILE:' part out")


def parse(overrides: list[str] | dict[str, Any], params_path: Path | None = None) -> list:
    """Hydra `Override`s. A list holds command-line strings; a dict (the Prefect flow's
    parameter) maps `[+|++|~]KEY` to a value already typed (JSON), applied by the same rules."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override, OverrideType, ValueType
    from hydra.errors import HydraException

    if isinstance(overrides, dict):
        parsed = []
        for key, value in overrides.items():
            kind, name = _kind(key, OverrideType)
            parsed.append(Override(type=kind, key_or_group=name, value_type=ValueType.ELEMENT,
                                   _value=value, input_line=f"{key}={value!r}"))
        return parsed
    parser, parsed = OverridesParser.create(), []
    for text in overrides:
        named, override = split_file(text)
        if named is not None and params_path is not None:
            check_file(named, params_path, text)
        try:
            one = parser.parse_override(override)
        except HydraException:
            raise PipelineError(f"override '{text}' is not {SYNTAX}") from None
        if one.is_sweep_override():
            raise PipelineError(f"override '{text}' is a sweep; one run takes one value "
                                "(sweeps are for dvc exp run -S ... --queue)")
        one.input_line = text
        parsed.append(one)
    return parsed


def _kind(key: str, override_type) -> tuple[Any, str]:
    for prefix, kind in (("++", override_type.FORCE_ADD), ("+", override_type.ADD),
                         ("~", override_type.DEL)):
        if key.startswith(prefix):
            return kind, key[len(prefix):]
    return override_type.CHANGE, key


def apply_overrides(raw: dict[str, Any], overrides: list[str] | dict[str, Any],
                    source: str = "the params file",
                    params_path: Path | None = None) -> dict[str, Any]:
    """A copy of `raw` with `overrides` applied as DVC applies `-S` to a params file."""
    if not overrides:
        return raw
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    config = OmegaConf.create(raw, flags={"allow_objects": True})
    OmegaConf.set_struct(config, True)
    for override in parse(overrides, params_path):
        try:  # one at a time, so a refusal names its own override
            ConfigLoaderImpl._apply_overrides_to_config([override], config)
        except ConfigCompositionException as exc:
            raise PipelineError(_explain(override, raw, source, exc)) from None
    return OmegaConf.to_container(config, resolve=False)


def _explain(override, raw: dict[str, Any], source: str, exc: Exception) -> str:
    """Hydra's refusal -> one line: the override, the key, what to write instead."""
    from finetune.config.schema import FinetuneConfig
    from finetune.config.section import dotted_keys

    keys = dotted_keys(FinetuneConfig)

    line, key = override.input_line, override.key_or_group
    plain = line.split(":", 1)[1] if ":" in line.partition("=")[0] else line
    if override.is_delete():
        if _holds_null(raw, key.split(".")):
            return (f"override '{line}': {source} sets '{key}' to null, which Hydra's delete "
                    "(as dvc exp run -S runs it) takes for no key; delete the line from the "
                    f"file, or set a value with '{plain.lstrip('~').split('=')[0]}=VALUE'")
        return f"override '{line}': {source} has no key '{key}' to delete"
    if override.is_add():
        return (f"override '{line}': {source} already has '{key}'; change it with "
                f"'{plain.lstrip('+')}' (or '+{plain}' to add or change)")
    if _present(raw, key.split(".")[:-1]) is False:
        return f"override '{line}': '{key.rsplit('.', 1)[0]}' is not a section in {source}"
    if key in keys:
        return (f"override '{line}': {source} has no key '{key}' (its default applies); add "
                f"it with '+{plain}', as dvc exp run -S needs")
    if "Could not override" in str(exc):
        from finetune.config.foreign import foreign

        known = foreign(key.rsplit(".", 1)[-1])  # HF's, TRL's or Axolotl's name: by meaning
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f" ({known})" if known else f" (did you mean '{close[0]}'?)" if close else ""
        return f"override '{line}': unknown key '{key}'{hint}"
    cause = exc.__cause__ or exc
    return f"override '{line}': {str(cause).splitlines()[0]}"


def _holds_null(raw: dict[str, Any], parts: list[str]) -> bool:
    """The dotted key is in `raw`, with the value null."""
    node: Any = raw
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and parts[-1] in node and node[parts[-1]] is None


def _present(raw: dict[str, Any], parts: list[str]) -> bool | None:
    """Is every part of the dotted path a section of `raw`? False when one is a value,
    None when one is missing."""
    node: Any = raw
    for part in parts:
        if not isinstance(node, dict):
            return False
        if part not in node:
            return None
        node = node[part]
    return isinstance(node, dict) or not parts
