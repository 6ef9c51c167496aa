"""The teacher: its folder checked, its vocabulary compared with the student's, the model
loaded frozen, and its side of a batch's trained tokens (the last hidden states of the target
rows only; the output layer is applied a chunk at a time by the loss, or top-k at a time by
the teacher stage).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from engine.modeling.model import base_model
from engine.objective.loss import target_rows
from engine.rollout.reward_model import TOKENIZER_FILES, model_files
from finetune.errors import PipelineError


def check_teacher(root: Path, ref: str, key: str) -> Path:
    """The teacher folder `ref` (relative to `root`) holds a causal LM's config and a
    tokenizer (read from config.json and file names: no weights loaded); else one line naming
    `key` and `ref`."""
    directory = Path(root) / ref
    if not directory.is_dir():
        raise PipelineError(f"{key}: teacher folder {ref} not found (a causal LM folder with "
                            "its tokenizer, or models:/NAME@alias)")
    model_dir, tokenizer_dir = model_files(directory)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise PipelineError(f"{key}: {ref} has no config.json: not a model folder")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise PipelineError(f"{key}: {ref} is not a causal LM (its config's architectures: "
                            f"{architectures}); a teacher predicts the next token")
    if not any((tokenizer_dir / f).exists() for f in TOKENIZER_FILES):
        raise PipelineError(f"{key}: {ref} has no tokenizer (save it next to the model)")
    return directory


def check_same_vocabulary(teacher_dir: Path, teacher_ref: str, student_tok,
                          student_ref: str, teacher_vocab: int | None = None,
                          student_vocab: int | None = None) -> None:
    """One line naming both models unless the teacher's tokenizer maps every token to the
    student's id (and, where given, both output layers have the same size): the divergence
    compares distributions over the same ids."""
    from transformers import AutoTokenizer

    _, tokenizer_dir = model_files(Path(teacher_dir))
    teacher_tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        t, s = teacher_tok.get_vocab(), student_tok.get_vocab()
        differ = sorted(set(t.items()) ^ set(s.items()), key=lambda kv: kv[1])
        first = f"e.g. {differ[0][0]!r}" if differ else ""
        raise PipelineError(
            f"distill.teacher: the teacher's tokenizer ({teacher_ref}, {len(t)} tokens) is not "
            f"the student's ({student_ref}, {len(s)} tokens; {first}): distillation compares "
            "next-token distributions over the same ids")
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise PipelineError(
            f"distill.teacher: the teacher's output layer ({teacher_ref}) has {teacher_vocab} "
            f"rows, the student's ({student_ref}) {student_vocab}: the same tokenizer, but "
            "the divergence needs the same vocabulary size")


def load_teacher(directory: Path, device: torch.device, dtype=torch.float32):
    """The teacher, frozen, in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = model_files(Path(directory))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


class TeacherRows:
    """The teacher's last hidden states at a batch's target rows ([rows, hidden], target-row
    order) without its full logits: its output layer is swapped, while `hidden_at` runs, for
    one that returns the hidden states of those rows. `head` is the layer's own forward."""

    def __init__(self, model):
        self.model = model
        layer = base_model(model).get_output_embeddings()
        self.head = layer.forward
        self._rows = None
        rows_of = self

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if rows_of._rows is None:
                return rows_of.head(hidden)
            return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows_of._rows)

        layer.forward = forward

    @contextlib.contextmanager
    def _selecting(self, rows: torch.Tensor):
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    @torch.no_grad()
    def hidden_at(self, inputs: dict, host_labels: torch.Tensor) -> torch.Tensor:
        rows, _ = target_rows(host_labels)
        device = next(self.model.parameters()).device
        with self._selecting(rows.to(device)):
            return self.model(**inputs, use_cache=False).logits
