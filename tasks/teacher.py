"""The teacher stage (between tokenize and train): for an offline distillation run
(`training.type: distill`, `distill.mode: offline`), the teacher's top-k next-token ids and
log-probabilities at every trained token of the tokenized train split, written once as
`data/teacher/train` (a saved split, row i for the tokenized split's row i, sharded as
`save_to_disk` shards, written a few rows at a time) beside `data/teacher/teacher.json` (what
was scored with what). DVC reruns it only when its inputs change (the tokenized split, the
teacher, `distill.top_k`, `distill.temperature`), so every later student run reuses it.

Any other run (not distill, or on-policy distillation, whose teacher scores the student's
own samples during training) writes only `teacher.json` saying so: no model is loaded and
nothing of torch is imported, so the default pipeline pays a process start for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import PipelineError
from finetune.files import atomic_dir
from finetune.workspace import Workspace

#: the stage's output, under the project root; the train stage hands `train` to the engine
TEACHER = Path("data/teacher")
MANIFEST = "teacher.json"


def offline(ws: Workspace) -> bool:
    """Whether `ws` is an offline distillation run (the one kind the stage scores for)."""
    c = ws.config
    return c.training.type == "distill" and c.distill.mode == "offline"


def teacher_columns(ws: Workspace) -> Path | None:
    """The teacher's columns a run of `ws` reads (offline distillation), else None; one line
    when the teacher stage scored another teacher, top_k or temperature than the params name
    now (a stage run by hand after an edit, or a teacher folder outside DVC's deps changed)."""
    if not offline(ws):
        return None
    c, out = ws.config, ws.root / TEACHER
    try:
        scored = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        scored = None
    if scored is None or not scored.get("scored"):
        raise PipelineError(f"{out}: no teacher columns for this distillation run; run the "
                            "teacher stage first (finetune stage teacher, or dvc repro)")
    d = c.distill
    folder = ws.root / d.teacher
    now = {"top_k": d.top_k, "temperature": d.temperature,
           **({"teacher_sha256": folder_hash(folder)} if folder.is_dir() else {})}
    stale = [k for k, v in now.items() if scored.get(k) != v]
    if stale:
        raise PipelineError(
            f"{out / MANIFEST}: the teacher stage scored another {' and '.join(stale)} than "
            f"distill.teacher {d.teacher} with top_k {d.top_k} and temperature "
            f"{d.temperature}; rerun it (dvc repro -f teacher)")
    return out / "train"


def folder_hash(folder: Path) -> str:
    """The content hash of a model folder's files (through finetune.hashing's file cache,
    so an unchanged folder is not read again)."""
    import hashlib

    from finetune.hashing import HashCache

    cache = HashCache.open()
    try:
        h = hashlib.sha256()
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(folder)}\0{cache.sha256(path)}\n".encode())
        return h.hexdigest()
    finally:
        cache.close()


def teacher(ws: Workspace) -> dict[str, Path]:
    """Run the stage: see the module docstring."""
    out = ws.root / TEACHER
    c = ws.config
    if not offline(ws):
        why = ("not a distillation run" if c.training.type != "distill" else
               "on-policy distillation: the teacher scores the student's samples in training")
        with atomic_dir(out) as staging:
            (staging / MANIFEST).write_text(json.dumps({"scored": False, "why": why},
                                                       indent=2) + "\n")
        return {"teacher": out}
    split = ws.layout.tokenized / "train"
    if not split.is_dir():
        raise PipelineError(f"{split}: no tokenized train split; run tokenize first "
                            "(data.streaming cannot be distilled offline)")
    from tasks import model_refs

    ws = model_refs.resolved(ws)  # a registered teacher: its downloaded folder
    d = ws.config.distill
    teacher_dir = ws.root / d.teacher
    from engine.prepare import load_tokenizer, teacher_scores

    student_tok = load_tokenizer(ws.config.model, ws.root)
    student = ws.config.model.tokenizer_name_or_path or ws.config.model.name_or_path
    features, batches = teacher_scores(teacher_dir, d.teacher, student_tok, student, split,
                                       d.top_k, d.temperature)
    with atomic_dir(out) as staging:
        write_columns(features, batches, staging / "train",
                      fingerprint=_fingerprint(split, teacher_dir, d.top_k, d.temperature))
        (staging / MANIFEST).write_text(json.dumps(
            {"scored": True, "teacher_sha256": folder_hash(teacher_dir), "top_k": d.top_k,
             "temperature": d.temperature}, indent=2) + "\n")
    print(f"[teacher] {d.teacher}: top {d.top_k} of every trained token of {split} -> "
          f"{out / 'train'}", flush=True)
    return {"teacher": out}


def write_columns(features, batches, dest: Path, fingerprint: str) -> None:
    """The scored batches as a saved split at `dest`: streamed into one Arrow file (one
    batch in memory at a time), then cut into `save_to_disk`'s shards (tasks.saved_split)."""
    from datasets.arrow_writer import ArrowWriter

    from tasks.saved_split import save_split

    scratch = dest.parent / ".scored.arrow"
    writer = ArrowWriter(features=features, path=str(scratch))
    try:
        for batch in batches:
            writer.write_batch(batch)
        writer.finalize()
    finally:
        writer.close()
    save_split(scratch, fingerprint, dest)
    scratch.unlink()


def _fingerprint(split: Path, teacher_dir: Path, top_k: int, temperature: float) -> str:
    """What the columns are a function of: the split's and the teacher's files (content
    hashes), top_k and temperature."""
    import hashlib

    from finetune.hashing import data_hash

    parts = [data_hash(split), folder_hash(teacher_dir), str(top_k), repr(temperature)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
