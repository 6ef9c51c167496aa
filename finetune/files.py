"""Writing files without losing earlier results, and hashing them.

Every stage and the engine write through these: a failing write leaves the previous complete
output in place (staging folder or temp file, then a rename), and content hashes are computed
one way everywhere (checkpoint integrity, lineage, stream manifests).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def file_sha256(path: Path, into: "hashlib._Hash | None" = None,
                also: "hashlib._Hash | None" = None) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks; `into` and `also` also feed
    running hashes (all files; one group of them)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            for running in (h, into, also):
                if running is not None:
                    running.update(chunk)
    return h.hexdigest()


#: below this many free bytes a failed write is taken for a full disk: some writers (torch's
#: zip serializer, safetensors) report ENOSPC as an opaque error of their own
NEARLY_FULL = 4 << 20


def as_disk_full(exc: BaseException, folder: Path) -> BaseException:
    """`exc`, or an OSError(ENOSPC) naming `folder` when the error says the disk is full
    without naming a file, or when the filesystem there is (nearly) full, so that callers
    explain a full disk as such, and where, whatever the writer raised. The error's own word
    counts first: under several ranks another one may free its half-written save before this
    one looks at the free space."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and exc.filename:
        return exc
    if not says_disk_full(exc):
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return exc
        if free >= NEARLY_FULL:
            return exc
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    full.__cause__ = exc
    return full


#: a full disk, as the OS says it and as writers with errors of their own put it (the text
#: of ENOSPC and EDQUOT, fsspec's StorageFull)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull")


def disk_full_error(exc: BaseException) -> bool:
    """Does this one exception (not its causes) say the disk is full?"""
    return ((isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS)
            or any(t in f"{type(exc).__name__}: {exc}" for t in DISK_FULL_TEXTS))


def says_disk_full(exc: BaseException) -> bool:
    """A full-disk error in the exception's chain or, for a wrapper that gathers several
    ranks' errors (DCP's CheckpointException: `failures`, rank -> (exception, traceback)), in
    theirs."""
    pending, seen = [exc], []
    while pending:
        for e in exception_chain(pending.pop()):
            if any(e is s for s in seen):
                continue
            seen.append(e)
            if disk_full_error(e):
                return True
            failures = getattr(e, "failures", None)
            if isinstance(failures, dict):
                pending += [pair[0] for pair in failures.values() if isinstance(pair, tuple)
                            and pair and isinstance(pair[0], BaseException)]
    return False


#: a write refused by the filesystem or its permissions, not by its size
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes, each once (DCP wraps a rank's error in its own)."""
    found: list[BaseException] = []
    while exc is not None and all(exc is not e for e in found):
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def refused_write(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain that says a write was refused (UNWRITABLE), if any."""
    return next((e for e in exception_chain(exc)
                 if isinstance(e, OSError) and e.errno in UNWRITABLE), None)


def as_unwritable(exc: BaseException, folder: Path) -> BaseException:
    """`exc`, or an OSError of the same errno naming `folder` when a write under it was
    refused (read-only filesystem, permissions): writers such as DCP name only their own file
    ('__0_0.distcp'), which says nothing about where."""
    refused = refused_write(exc)
    if refused is None:
        return exc
    named = OSError(refused.errno, os.strerror(refused.errno), str(folder))
    named.__cause__ = exc
    return named


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty staging folder that replaces `final` only if the block succeeds.

    A failing stage leaves the previous successful output untouched (under `dvc repro`, which
    deletes a stage's outs before running it, the failed stage puts them back from DVC's
    cache: flows/dvc_restore.py).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes 0700; outputs should look like any dir
    with discard_on_failure(staging):
        yield staging
    replace_dir(staging, final)


@contextlib.contextmanager
def discard_on_failure(staging: Path, remove: bool = True) -> Iterator[None]:
    """A failing block leaves no half-written `staging` behind (`remove`: this process owns
    it), a failure on a full disk is raised as OSError(ENOSPC) whatever the writer raised, and
    a refused write (read-only, permissions) as an OSError naming the folder.
    Catches BaseException: torch's distributed checkpoint raises its own BaseException."""
    try:
        yield
    except BaseException as exc:
        error = exc
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            error = as_disk_full(exc, staging)  # before the removal frees the space
            if error is exc:
                error = as_unwritable(exc, staging.parent)
        if remove:
            shutil.rmtree(staging, ignore_errors=True)
        if error is exc:
            raise
        raise error from exc


def replace_dir(src: Path, final: Path) -> None:
    """Swap `src` into `final` with renames (the old copy is removed last)."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(src, final)
    shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def remove_interrupted_writes(folder: Path) -> list[Path]:
    """Staging and set-aside folders that interrupted writes left in `folder` and one level
    below (`.NAME.tmp-*` from atomic_dir, `.NAME.old-PID` from replace_dir), removed; returns
    them. Call only while holding the workspace lock: then no live run owns any of them."""
    import re

    leftover = re.compile(r"^\..+\.(tmp-[A-Za-z0-9_]+|old-\d+)$")
    found = [p for p in [*folder.glob(".*"), *folder.glob("*/.*")]
             if p.is_dir() and not p.is_symlink() and leftover.match(p.name)]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found
