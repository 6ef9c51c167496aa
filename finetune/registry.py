"""Name -> object tables (dataset types, trainer types, ...): one helper for what each of them
needs, so that every such key resolves and fails the same way.

A `Registry` holds what a config key can name: objects registered under a name (with
`register`, also a class decorator), aliases for them, built-ins given as `"module:name"`
strings that are imported only when first looked up (the engine does not import every trainer
at start-up), and, for any key, a class named by reference (`module:Class` or
`path/to/file:Class`, through finetune.imports.load_object). An unknown name is one line naming
the key, the name, the closest known name and the known ones; a looked-up class that is not a
subclass of the registry's base is refused. Both messages and the exception type are
parameters, so each table keeps the wording its users (and tests) already know.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar

from finetune.errors import PipelineError
from finetune.imports import load_object

T = TypeVar("T")

#: fields: key, label, name, hint (`hint` filled with the closest known name, else ''),
#: names (registration order), sorted_names, aliases ('alias = name, ...')
UNKNOWN = ("{key} '{name}': no such {label} (registered: {sorted_names}; or name a class as "
           "'module:Class'){hint}")
HINT = " (did you mean '{}'?)"
#: fields: key, label, name, obj (the object looked up), base ('module.Class' of the base)
NOT_A_SUBCLASS = "{key} '{name}': {obj!r} is not a subclass of {base}"


class Registry(Generic[T]):
    """The objects one config key can name.

    `label`: what they are, for messages ("dataset type"); `key`: the config key
    ("data.dataset_type"), for messages and load_object's errors. `base`: when given, every
    object looked up must be a subclass of it: a class, a `"module:Class"` string or a callable
    returning the class (resolved at lookup, so the base may be registered or imported later).
    `built_ins`: name -> object or `"module:name"` string (imported on first lookup).
    `error`: the exception type of the unknown-name and not-a-subclass refusals; `unknown`,
    `hint` and `not_a_subclass`: their format strings (see UNKNOWN, HINT, NOT_A_SUBCLASS).
    A failed import of a reference or a built-in is load_object's PipelineError, unchanged.
    """

    def __init__(self, label: str, key: str, *, base: Any = None,
                 built_ins: Mapping[str, Any] | None = None,
                 error: Callable[[str], Exception] = PipelineError, unknown: str = UNKNOWN,
                 hint: str = HINT, not_a_subclass: str = NOT_A_SUBCLASS) -> None:
        self.label, self.key, self.base = label, key, base
        self.error, self.unknown, self.hint, self.not_a_subclass = (error, unknown, hint,
                                                                     not_a_subclass)
        self._entries: dict[str, Any] = {}  # name -> object, or "module:name" until looked up
        self._aliases: dict[str, str] = {}  # alias -> name
        for name, obj in (built_ins or {}).items():
            self.register(name, obj)

    # -- filling ---------------------------------------------------------------------------

    def register(self, name: str, obj: Any = None, aliases: Iterable[str] = ()):
        """Make `obj` known as `name` (and `aliases`); `obj` may be a `"module:name"` string,
        imported on first lookup. Without `obj`, a decorator: `@reg.register("mine")`.
        Returns `obj`. A name registered again is replaced."""
        def add(target):
            self._entries[name] = target
            for alias in aliases:
                self._aliases[alias] = name
            return target

        return add(obj) if obj is not None else add

    # -- looking up ------------------------------------------------------------------------

    def get(self, name: str, check: bool = True) -> T:
        """The object `name` stands for: a registered name, an alias or a `module:Class` /
        `path/to/file.py:Class` reference; checked against `base` unless `check` is false (a
        base registered in its own table: `base=lambda: reg.get("sft", check=False)`). Else
        one line (`unknown`)."""
        target = self._aliases.get(name, name)
        if target in self._entries:
            obj = self._entries[target]
            if isinstance(obj, str):  # a lazy built-in: imported now, once
                obj = self._entries[target] = load_object(obj, self.key)
        elif self.is_reference(name):
            obj = load_object(name, self.key)
        else:
            raise self.unknown_name(name)
        if check:
            self._check(name, obj)
        return obj

    def canonical(self, name: str) -> str:
        """The name a config value stands for: an alias's name, a registered name or a
        reference as written (after checking it loads); an unknown name is `unknown`."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        self.get(name)
        return name

    @staticmethod
    def is_reference(name: str) -> bool:
        """Whether `name` is written as a `module:name` reference rather than a key."""
        return ":" in name

    def __contains__(self, name: object) -> bool:
        """A registered name or alias (references are not `in` a registry)."""
        return name in self._entries or name in self._aliases

    def names(self) -> list[str]:
        """The registered names (built-ins included, aliases not), in registration order."""
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        """alias -> the name it stands for."""
        return dict(self._aliases)

    def known(self) -> list[str]:
        """Every name a key may use: names, then aliases (what did-you-mean picks from)."""
        return [*self._entries, *self._aliases]

    # -- refusing --------------------------------------------------------------------------

    def unknown_name(self, name: str) -> Exception:
        """The `error` for a name that is neither registered, an alias nor a reference."""
        close = difflib.get_close_matches(name, self.known(), n=1, cutoff=0.6)
        return self.error(self.unknown.format(
            key=self.key, label=self.label, name=name,
            hint=self.hint.format(close[0]) if close else "",
            names=", ".join(self._entries), sorted_names=", ".join(sorted(self._entries)),
            aliases=", ".join(f"{a} = {n}" for a, n in self._aliases.items())))

    def base_class(self) -> type | None:
        """`base` resolved: a class as given, a `"module:Class"` string imported, a callable
        called."""
        base = self.base
        if base is None or isinstance(base, type):
            return base
        if isinstance(base, str):
            return load_object(base, self.key)
        return base()

    def _check(self, name: str, obj: Any) -> None:
        base = self.base_class()
        if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
            raise self.error(self.not_a_subclass.format(
                key=self.key, label=self.label, name=name, obj=obj,
                base=f"{base.__module__}.{base.__qualname__}"))
