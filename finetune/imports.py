"""`module:name` references: how a params file names user code (callbacks, model classes,
prompt functions) and how the launcher names the worker's stream source. The module may also be
a file of the project, as QEfficient writes it: `preprocess/alpaca_func:create_alpaca_prompt` is
`preprocess/alpaca_func.py` of the project, `name` in it: relative to the project root while a
params file is validated (`project_files`), else to the working directory (the project root in
every stage and worker).

One loader so that every such key fails the same way: one line naming the key, the reference
and why it could not be imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator

from finetune.errors import PipelineError

_project_root: Path | None = None


@contextlib.contextmanager
def project_files(root: Path) -> Iterator[None]:
    """While a params file is validated, its file references resolve against its project (a
    `finetune validate -p other/params.yaml` run from anywhere finds the project's files)."""
    global _project_root
    before, _project_root = _project_root, root
    try:
        yield
    finally:
        _project_root = before


def project_root() -> Path:
    """The folder a params file's relative paths resolve against: its project while it is
    validated (`project_files`), else the working directory (every stage's and worker's is
    the project root)."""
    return _project_root or Path.cwd()


def load_object(ref: str, key: str) -> Any:
    """'package.module:name' -> the object it names; a failure is one line naming `key`."""
    module_name, _, attr = ref.partition(":")
    module = module_of(ref, key)
    if not hasattr(module, attr):
        raise PipelineError(
            f"{key}: cannot import '{ref}' (module '{module_name}' has no attribute '{attr}')")
    return getattr(module, attr)


def module_of(ref: str, key: str):
    """The module a 'package.module:name' reference names, imported (a file's loaded once);
    a failure is one line naming `key`."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise PipelineError(f"{key}: '{ref}' must look like 'package.module:name' or "
                            "'path/to/file:name'")
    try:
        if "/" in module_name or module_name.endswith(".py"):
            module = _from_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise PipelineError(f"{key}: cannot import '{ref}' ({exc})") from None
    except Exception as exc:  # the user's file failed while it ran
        raise PipelineError(f"{key}: '{ref}' failed to load: {type(exc).__name__}: {exc}"
                            ) from None
    return module


def _from_file(name: str):
    """`path/to/file` or `path/to/file.py` -> that file, loaded once as a module."""
    path = Path(name if name.endswith(".py") else f"{name}.py")
    path = (_project_root / path if _project_root and not path.is_absolute() else path).resolve()
    if not path.is_file():
        raise ImportError(f"no file {path}")
    module_name = f"finetune_user_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
