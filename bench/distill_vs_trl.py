"""One distillation step on the CPU: ours (engine.recipe.distill: the GKD loss through the
student's own output layer, a chunk of trained positions at a time) against TRL's
`GKDTrainer.training_step` (trl.experimental.gkd, lmbda 0: the data's completions, so no
sampling on either side), the same student, teacher, rows and settings, measured in the same
process, the sides taking turns. Then what the offline teacher stage saves: its one-off cost
(the teacher scored over the rows once) against the teacher's forward in every step, over N
student runs.

Settings, both sides: the student and the teacher are `--model` (the teacher a copy with
seeded noise on its weights, so the two differ), full fine-tuning, fp32, AdamW lr 1e-4,
beta 0.5, temperature 1, `--batch` GSM8K rows ("Question: ...\\nAnswer:" + " answer", prompt
unlabelled) per step. Our sides:
- `ours (teacher in step)`: the teacher's hidden states at the trained positions, its output
  layer a chunk at a time (distill.mode on_policy with lmbda 0 trains this way);
- `ours (offline top-k)`: the teacher stage's columns (top_k ids and log-probs), no teacher
  forward in the step (distill.mode offline).
Each step is timed boundary to boundary (forward, loss, backward, optimizer step); the first
`--warmup` are dropped and the table gives medians.

Do not run it while other work loads the machine; `--smoke` runs two steps on the tiny model
(a check that the script runs, not a measurement).

    python bench/distill_vs_trl.py --smoke
    python bench/distill_vs_trl.py --model data/models/stories260K --batch 8 --steps 12
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gsm8k_batch(tok, rows: int, offset: int = 0):
    import torch

    lines = (ROOT / "data/source/gsm8k/train.jsonl").read_text().splitlines()
    ids, labels = [], []
    for line in lines[offset:offset + rows]:
        row = json.loads(line)
        p = tok(f"Question: {row['question']}\nAnswer:")["input_ids"]
        c = tok(" " + row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append((p + c)[:256])
        labels.append(([-100] * len(p) + c)[:256])
    n = max(map(len, ids))
    batch = {"input_ids": torch.full((rows, n), tok.pad_token_id),
             "attention_mask": torch.zeros(rows, n, dtype=torch.long),
             "labels": torch.full((rows, n), -100)}
    for i, (x, y) in enumerate(zip(ids, labels)):
        batch["input_ids"][i, :len(x)] = torch.tensor(x)
        batch["attention_mask"][i, :len(x)] = 1
        batch["labels"][i, :len(y)] = torch.tensor(y)
    return batch


def models(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    teacher = copy.deepcopy(student)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp_min(1e-3))
    teacher.eval().requires_grad_(False)
    return student, teacher, tok


def trl_side(student, teacher, tok, workdir: Path):
    import datasets
    from trl.experimental import gkd

    args = gkd.GKDConfig(output_dir=str(workdir / "trl"), beta=0.5, lmbda=0.0,
                         temperature=1.0, report_to=[], use_cpu=True, bf16=False,
                         learning_rate=1e-4, save_strategy="no", max_steps=1000,
                         per_device_train_batch_size=1, seq_kd=False)
    data = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "x"}]]})
    trainer = gkd.GKDTrainer(model=student, teacher_model=teacher, args=args,
                             train_dataset=data, processing_class=tok)
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop
    trainer.model.train()

    def step(batch):
        loss = trainer.training_step(trainer.model, dict(batch))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step


def our_side(student, teacher, offline: bool, top_k: int, batches: list):
    import torch

    from engine.objective.loss import target_rows
    from engine.recipe.distill.loss import DistillLoss, Teacher, Weights, log_probs
    from engine.recipe.distill.teacher import TeacherRows

    student.train()
    loss = DistillLoss(student, Weights(0.5, 1.0), 1024, torch.device("cpu"))
    scorer = TeacherRows(teacher)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    columns = {}
    for batch in batches if offline else ():  # what the teacher stage wrote, before any run
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        hidden = scorer.hidden_at(inputs, batch["labels"])
        with torch.no_grad():
            top = log_probs(scorer.head(hidden), 1.0).topk(top_k, dim=-1)
        columns[id(batch)] = (top.indices, top.values)

    def teacher_side(batch, inputs):
        if not offline:
            return Teacher(hidden=scorer.hidden_at(inputs, batch["labels"]), head=scorer.head)
        ids, lps = columns[id(batch)]
        return Teacher(ids=ids, logps=lps)

    def step(batch):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        teacher_cols = teacher_side(batch, inputs)
        with loss.computing(batch["labels"], teacher_cols):
            summed = loss.loss_sum(student(**inputs, use_cache=False))
        n = len(target_rows(batch["labels"])[0])
        (summed / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(summed.detach()) / n

    return step


def scoring_seconds(teacher, batches, top_k: int) -> float:
    """The teacher stage's work for these rows: its forward and top-k per trained token."""
    import torch

    from engine.recipe.distill.loss import log_probs
    from engine.recipe.distill.teacher import TeacherRows

    scorer = TeacherRows(copy.deepcopy(teacher))
    start = time.perf_counter()
    for batch in batches:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        hidden = scorer.hidden_at(inputs, batch["labels"])
        with torch.no_grad():
            log_probs(scorer.head(hidden), 1.0).topk(top_k, dim=-1)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "data/models/stories260K"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--runs", default="1,5,20", help="student runs for the amortisation table")
    ap.add_argument("--smoke", action="store_true", help="2 steps, batch 2: a check, no numbers")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.warmup = 2, 2, 0
    import torch

    torch.manual_seed(0)
    student, teacher, tok = models(args.model)
    batches = [gsm8k_batch(tok, args.batch, i * args.batch) for i in range(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"trl GKDTrainer": trl_side(copy.deepcopy(student), copy.deepcopy(teacher), tok,
                                            Path(tmp)),
                 "ours (teacher in step)": our_side(copy.deepcopy(student),
                                                    copy.deepcopy(teacher), False, args.top_k,
                                                    batches),
                 "ours (offline top-k)": our_side(copy.deepcopy(student),
                                                  copy.deepcopy(teacher), True, args.top_k,
                                                  batches)}
        times = {name: [] for name in sides}
        losses = {name: [] for name in sides}
        for batch in batches:
            for name, step in sides.items():  # the sides take turns on each batch
                start = time.perf_counter()
                losses[name].append(step(batch))
                times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t[args.warmup:] or t) for n, t in times.items()}
    trl = med["trl GKDTrainer"]
    print("| side | median step (s) | vs TRL | first loss |\n|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m:.4f} | {trl / m:.2f}x | {losses[name][0]:.6f} |")
    scored = scoring_seconds(teacher, batches, args.top_k)
    per_step_teacher = max(med["ours (teacher in step)"] - med["ours (offline top-k)"], 0.0)
    print(f"\nteacher stage over these {len(batches) * args.batch} rows: {scored:.3f} s once; "
          f"the teacher's share of a step: {per_step_teacher:.4f} s")
    print("\n| student runs | teacher in every step (s) | offline: stage once + runs (s) |")
    print("|---|---|---|")
    for n in (int(x) for x in args.runs.split(",")):
        online = n * len(batches) * med["ours (teacher in step)"]
        offline = scored + n * len(batches) * med["ours (offline top-k)"]
        print(f"| {n} | {online:.3f} | {offline:.3f} |")
    if args.smoke:
        print("(--smoke: a check that the bench runs; these are not measurements)")


if __name__ == "__main__":
    main()
