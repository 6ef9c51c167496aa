"""Put a failed stage's previous outputs back, from DVC's cache.

dvc.yaml declares no out `persist` so that DVC's run-cache works (a stage whose code, params
and data equal a run DVC has seen is restored instead of run again; DVC keeps no run-cache for
a stage with a persistent out). The price: DVC deletes a stage's outs just before its cmd, so
a stage that then fails would leave the workspace without them. `finetune stage NAME`, run by
`dvc repro` as the stage's cmd (DVC sets DVC_STAGE), calls `restore_previous_outputs` when it
fails: every out that dvc.lock records for the stage and that is now missing comes back, by its
md5, from DVC's cache (cached outs; metrics and plots too, which the run-cache stores there) or
else from git's HEAD (metrics and plots that git keeps). DVC releases its repository lock
while a cmd runs, so reading its config and cache from the cmd is safe. What cannot be found
(a fresh clone whose outputs were never in this cache) is named, with `dvc pull` as the way.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import yaml

#: the guard stage: a failed validation must not leave a "passed" marker behind
NOT_RESTORED = ("validate",)


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # noqa: S324 - DVC's content address, not security


def _locked_outs(root: Path, stage: str) -> list[dict]:
    lock = root / "dvc.lock"
    if not lock.exists():
        return []
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return [o for o in stages.get(stage, {}).get("outs", []) if o.get("md5")]


def _cache_object(root: Path) -> Callable[[str], Path | None]:
    """md5 -> the path DVC's cache keeps that object at (this clone's cache, or the shared
    one its config names), None when the cache lacks it."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        odb = repo.cache.local

    def find(md5: str) -> Path | None:
        path = Path(odb.oid_to_path(md5))
        return path if path.is_file() else None

    return find


def _from_git(root: Path, rel: str, md5: str) -> bytes | None:
    """The file as git's HEAD has it, if that is the version dvc.lock records."""
    proc = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=root, capture_output=True)
    if proc.returncode == 0 and _md5(proc.stdout) == md5:
        return proc.stdout
    return None


def _restore_dir(find, target: Path, md5: str) -> bool:
    manifest = find(md5)
    if manifest is None:
        return False
    entries = json.loads(manifest.read_text())
    objects = [(e["relpath"], find(e["md5"])) for e in entries]
    if any(obj is None for _, obj in objects):
        return False
    staging = target.with_name(f".{target.name}.tmp-restore")
    shutil.rmtree(staging, ignore_errors=True)
    for rel, obj in objects:
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(obj, dest)
    staging.rename(target)
    return True


def restore_previous_outputs(root: Path, stage: str) -> tuple[list[str], list[str]]:
    """After `stage` failed under `dvc repro`: its missing outs back as dvc.lock records them.
    Returns (restored paths, paths that could not be restored)."""
    if stage in NOT_RESTORED:
        return [], []
    outs = [o for o in _locked_outs(root, stage) if not (root / o["path"]).exists()]
    if not outs:
        return [], []
    find = _cache_object(root)
    restored, missing = [], []
    for out in outs:
        rel, md5, target = out["path"], out["md5"], root / out["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if md5.endswith(".dir"):
            ok = _restore_dir(find, target, md5)
        else:
            obj = find(md5)
            data = obj.read_bytes() if obj is not None else _from_git(root, rel, md5)
            ok = data is not None
            if ok:
                tmp = target.with_name(f".{target.name}.tmp-restore")
                tmp.write_bytes(data)
                tmp.replace(target)
        (restored if ok else missing).append(rel)
    return restored, missing


def restored_note(stage: str, restored: list[str], missing: list[str]) -> str | None:
    """One line for the stage's output (not an `error:` line: the failure has its own)."""
    if not restored and not missing:
        return None
    parts = []
    if restored:
        parts.append(f"put back the previous outputs DVC deleted before the run: "
                     f"{', '.join(restored)}")
    if missing:
        parts.append(f"not in DVC's cache, so not put back: {', '.join(missing)} "
                     f"(`dvc pull {stage}` fetches them from the remote)")
    return f"[{stage}] " + "; ".join(parts)
