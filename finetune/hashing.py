"""Content hashes of the files a run reads, through one cache of file hashes kept across runs:
the checkpoint fingerprint (engine.state.fingerprint) hashes the tokenized split and the base
model, and the train stage records the same split's hash as the MLflow dataset's digest
(tasks.tracking), so a split hashed once is not read again by either. Kept below the engine and
the stages because both ask it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from finetune.files import file_sha256, write_json_atomic


def data_hash(identity: Path | None) -> str | None:
    """The content hash of a tokenized split (a folder: its .arrow files) or a stream manifest
    (a file); None when there is none."""
    cache = HashCache.open()
    try:
        return data_hash_with(identity, cache)
    finally:
        cache.close()


def data_hash_with(identity: Path | None, cache: "HashCache") -> str | None:
    """`data_hash` through an open cache (the fingerprint hashes data and model in one)."""
    if identity is None or not identity.exists():
        return None
    files = [identity] if identity.is_file() else sorted(identity.rglob("*.arrow"))
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.relative_to(identity) if identity.is_dir() else path.name}\0".encode())
        h.update(cache.sha256(path).encode())
    return h.hexdigest()


class HashCache:
    """SHA-256 of files keyed by (path, size, mtime_ns, inode), kept across runs."""

    LIMIT = 4096

    def __init__(self, file: Path, entries: dict[str, str]):
        self.file, self.entries, self.dirty = file, entries, False

    @classmethod
    def open(cls) -> "HashCache":
        root = os.environ.get("FINETUNE_CACHE_DIR") or Path.home() / ".cache" / "finetune"
        file = Path(root) / "sha256.json"
        try:
            entries = json.loads(file.read_text())
        except (OSError, ValueError):
            entries = {}
        return cls(file, entries if isinstance(entries, dict) else {})

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        if key not in self.entries:
            self.entries[key] = file_sha256(path)
            self.dirty = True
            for stale in list(self.entries)[:-self.LIMIT]:  # oldest first
                del self.entries[stale]
        return self.entries[key]

    def close(self) -> None:
        if self.dirty:
            try:
                write_json_atomic(self.file, self.entries)
            except OSError:  # a read-only home: hashing again next time is the only cost
                pass
