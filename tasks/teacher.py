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


def teacher_columns(ws: Workspace) -> Path | None:
    """The teacher's columns a run of `ws` reads (offline distillation), else None."""
    c = ws.config
    if c.training.type == "distill" and c.distill.mode == "offline":
        return ws.root / TEACHER / "train"
    return None


def teacher(ws: Workspace) -> dict[str, Path]:
    """Run the stage: see the module docstring."""
    out = ws.root / TEACHER
    c = ws.config
    if teacher_columns(ws) is None:
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
            {"scored": True, "teacher": d.teacher, "top_k": d.top_k,
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

    from finetune.files import file_sha256
    from finetune.hashing import data_hash

    files = sorted(p for p in teacher_dir.rglob("*") if p.is_file())
    parts = [data_hash(split), *(f"{p.relative_to(teacher_dir)}:{file_sha256(p)}"
                                 for p in files), str(top_k), repr(temperature)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
