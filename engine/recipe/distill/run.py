"""`training.type: distill`: the SFT run with TRL GKD's loss (engine.recipe.distill.loss)
towards a teacher's next-token distributions.

What changes from `TrainingRun`, through its hooks only (the loop, the strategies, checkpoints
and resume are the SFT run's):
- `prepare_model`: the distillation loss installed on the student's output layer; offline,
  the teacher stage's columns opened (`RunPaths.method_columns`); on-policy, the teacher
  loaded frozen on this rank's device and the student's generator (the rollout room's
  LocalGenerator);
- `prepare_step`: offline, each micro-batch gets its rows' teacher columns (the loader's
  `rows` say which split rows it holds); on-policy, with probability `lmbda` (a draw seeded by
  training.seed and the step, the same on every rank, so a resumed run draws the same) each
  micro-batch's prompts are completed by the student, each seeded by the step and its split
  row (so 2 processes sample what 1 does), and the batch becomes those completions masked as
  TRL's GKDTrainer masks them (engine.recipe.distill.sampling);
- `micro_step`: the student's forward returns the summed loss of the trained tokens against the
  teacher's (its columns, or its hidden states at those tokens, the output layer applied a
  chunk at a time); the step's loss is the sum over its trained tokens divided by their count
  (all micro-batches, all ranks), TRL's reduction;
- `heldout_metrics`: the evaluate stage's numbers, the SFT run's plus the teacher's held-out
  loss and the student's top-1 agreement with it (engine.recipe.distill.heldout).

The in-training evaluation is the SFT run's (the held-out cross entropy).
"""

from __future__ import annotations

import torch

from engine.datapath.data import model_inputs
from engine.modeling.model import base_model
from engine.modeling.runtime import activation_offloading
from engine.recipe.distill.loss import DistillLoss, Teacher, Weights
from engine.recipe.distill.sampling import completion_batch
from engine.recipe.run import TrainingRun
from finetune.errors import PipelineError

#: the columns the teacher stage adds to a host micro-batch (offline)
TEACHER_KEYS = ("teacher_ids", "teacher_logps")


class DistillRun(TrainingRun):
    """A distillation run: see the module docstring."""

    # -- building --------------------------------------------------------------------------
    def prepare_model(self) -> None:
        super().prepare_model()
        d, t = self.cfg.distill, self.cfg.training
        self.d = d
        # on the model inside the strategy's wrapper (DDP's has no output embeddings)
        self.distill_loss = DistillLoss(self.strategy.module,
                                        Weights(d.beta, d.temperature, d.alpha),
                                        t.loss_chunk_tokens or 1024, self.dist.device)
        self.columns_table = self.scorer = self.generator = None
        if d.mode == "offline":
            from engine.recipe.distill.score import TeacherColumns

            path = self.paths.method_columns
            if path is None or not path.exists():
                raise PipelineError(
                    f"distill.mode offline: no teacher columns at {path} (run the teacher "
                    "stage first: finetune stage teacher, or dvc repro)")
            vocab = base_model(self.strategy.module).get_output_embeddings().weight.shape[0]
            self.columns_table = TeacherColumns(path, min(d.top_k, vocab))  # as the stage
            return
        self.scorer = self.load_teacher()
        from engine.rollout.local import LocalGenerator, eos_ids
        from engine.rollout.sampling import SamplingParams

        module = self.strategy.module
        self.eos = eos_ids(self.tokenizer, module)
        self.generator = LocalGenerator(
            module, SamplingParams(d.max_new_tokens, temperature=d.temperature),
            self.eos, self.tokenizer.pad_token_id, all_finished=self.strategy.generation_done)

    def load_teacher(self):
        """The teacher (distill.teacher, resolved by the train stage to a folder), frozen on
        this rank's device, its vocabulary checked against the student's."""
        from pathlib import Path

        from engine.recipe.distill.teacher import (
            TeacherRows,
            check_same_vocabulary,
            load_teacher,
        )

        folder = Path(self.paths.project_root) / self.d.teacher
        student = self.cfg.model.tokenizer_name_or_path or self.cfg.model.name_or_path
        teacher = load_teacher(folder, self.dist.device)
        student_head = base_model(self.strategy.module).get_output_embeddings()
        check_same_vocabulary(folder, self.d.teacher, self.tokenizer, student,
                              teacher.get_output_embeddings().weight.shape[0],
                              student_head.weight.shape[0])
        return TeacherRows(teacher)

    # -- the step --------------------------------------------------------------------------
    def prepare_step(self, micro: list[dict]) -> list[dict]:
        if self.columns_table is not None:
            for b in micro:
                ids, logps = self.columns_table.batch(b["rows"].tolist(), b["labels"],
                                                      torch.device("cpu"))
                b["teacher_ids"], b["teacher_logps"] = ids, logps
            return micro
        step = self.progress.step
        # the same draw on every rank (a sharded model's generation is collective)
        coin = torch.rand((), generator=torch.Generator().manual_seed(
            _mix(self.cfg.training.seed or 0, step))).item()
        if coin >= self.d.lmbda:  # the data's completions, scored by the teacher in the step
            return micro
        return [self.sampled(b, step) for b in micro]

    def sampled(self, host: dict, step: int) -> dict:
        """The micro-batch with its completions replaced by the student's samples of its
        prompts (each row's tokens before its first trained one), each seeded by the step and
        its split row, so a row samples the same on any rank and in any micro-batch."""
        from engine.rollout.generator import left_pad

        labels, ids = host["labels"], host["input_ids"]
        trained = labels[:, 1:] != -100
        first = torch.where(trained.any(1), trained.int().argmax(1) + 1, labels.shape[1])
        prompts = [row[:n].tolist() for row, n in zip(ids, first.tolist())]
        prompt_ids, prompt_mask = left_pad(prompts, self.tokenizer.pad_token_id)
        device = self.dist.device
        seeds = [_mix(self.cfg.training.seed or 0, step, r) for r in host["rows"].tolist()]
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            out = self.generator.generate(prompt_ids.to(device), prompt_mask.to(device), 1,
                                          seeds)
        batch = completion_batch(prompt_ids.to(device), prompt_mask.to(device), out.ids,
                                 self.eos)
        keep = {k: v for k, v in host.items() if k not in ("input_ids", "attention_mask",
                                                             "labels", "position_ids")}
        return {**keep, **{k: v.cpu() for k, v in batch.items()}}

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Forward the student (its head returns the summed distillation loss), backward the
        sum over `divisor` (the step's trained tokens); returns the sum."""
        inputs = model_inputs(batch)
        device = self.dist.device
        if self.columns_table is not None:
            teacher = Teacher(ids=batch["teacher_ids"], logps=batch["teacher_logps"])
        else:
            with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
                hidden = self.scorer.hidden_at(inputs, host_labels)
            teacher = Teacher(hidden=hidden, head=self.scorer.head)
        with activation_offloading(self.cfg.training, device):
            with (torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None),
                  self.distill_loss.computing(host_labels, teacher)):
                output = self.model(**inputs, use_cache=False)
            loss_sum = self.distill_loss.loss_sum(output)
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum.detach()

    # -- the evaluate stage ----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        """The SFT run's numbers, and the teacher's held-out loss and the student's top-1
        agreement with it, base and tuned (engine.recipe.distill.heldout); then a subclass's
        own `after_loss`."""
        from engine.recipe.distill.heldout import teacher_numbers

        def with_teacher(held, results: dict) -> None:
            teacher_numbers(held, results)
            if after_loss is not None:
                after_loss(held, results)

        return super().heldout_metrics(held, after_loss=with_teacher)


def _mix(*values: int) -> int:
    """A seed from several integers (the same on every run with the same ones)."""
    seed = 0x9E3779B9
    for v in values:
        seed = (seed * 1_000_003 + int(v) + 1) % (2 ** 63 - 1)
    return seed
