"""The baseline: `transformers.Trainer` set up the way its users do SFT, on our examples.

Run as its own process (so its peak RSS is its own):

    python bench/hf_trainer.py SPEC.json OUT.json

SPEC names the tokenized train split (completion-only labels, made by our tokenize stage, so
both trainers see identical token ids), the model folder, precision, batch, steps and optimiser
settings, and `order`: the example order our trainer uses (its seeded permutation). The
dataset is put in that order and read sequentially, so step k of both trainers sees the same
examples and the final losses must agree; with Trainer's own RandomSampler they would differ
by sampling noise and the comparison would say nothing about correctness.

CPU peers (bench/peers_cpu.py): `peft` ({r, lora_alpha, target_modules}) wraps the model in
peft's LoRA, `base_bf16` loads the base model's weights in bf16 first; `save_dir` saves the
trained model (or adapter) there after the timed run, for a held-out loss both sides compute
the same way.

GPU options (bench/gpu.py): `trainer: trl` runs TRL's SFTTrainer with padding_free (the
examples' completion masks from our labels), `liger` its use_liger_kernel, `cudnn: false`
turns cuDNN SDPA off for the run, `compile` sets TrainingArguments' `torch_compile` (TRL's
config inherits it), `profile` ({out_dir, wait, active}) traces steps with our engine's
profiler after `wait` steps and one warm-up step, writing the same ops table and trace files
as our rows do (bench/gpu.py --profile), and
`timer` ({path, boundaries}) marks synchronised times at
those steps (bench/gpu_timer.py).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def step_profiler(out_dir: str, wait: int, active: int):
    """A TrainerCallback driving our engine's own `logging.profiler` (engine.reporting.
    profiler.StepProfiler: the same schedule, ops table and trace files as our rows): `wait`
    steps, one warm-up step, then `active` traced steps. The peers' side of
    bench/gpu.py --profile."""
    from pathlib import Path

    import torch
    from transformers import TrainerCallback

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.reporting.profiler import StepProfiler
    from finetune.config.reporting import ProfilerConfig

    cfg = ProfilerConfig(enabled=True, wait_steps=wait, warmup_steps=1, active_steps=active)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    class Traced(TrainerCallback):
        profiler = None

        def on_train_begin(self, args, state, control, **kw):
            self.profiler = StepProfiler(cfg, Path(out_dir), device, 0, print)

        def on_step_end(self, args, state, control, **kw):
            self.profiler.step(state.global_step)

        def on_train_end(self, args, state, control, **kw):
            self.profiler.__exit__(None, None, None)

    return Traced()


def main(spec_path: str, out_path: str) -> None:
    import datasets
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                              Trainer, TrainerCallback, TrainingArguments)

    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(spec["threads"])
    if not spec.get("cudnn", True):
        torch.backends.cuda.enable_cudnn_sdp(False)
    trl = spec.get("trainer", "hf") == "trl"
    rows = datasets.load_from_disk(spec["train"]).select_columns(["input_ids", "labels"])
    rows = rows.select(spec["order"])
    if trl:  # TRL masks the prompt through completion_mask (it rebuilds labels from ids)
        rows = rows.map(lambda r: {"completion_mask": [int(x != -100) for x in r["labels"]]})
    tok = AutoTokenizer.from_pretrained(spec["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(spec["seed"])
    # `base_bf16`: the frozen base weights loaded in bf16 (peft keeps the adapter in fp32),
    # the usual LoRA setting where memory or speed counts
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.bfloat16 if spec.get("base_bf16") else torch.float32,
        attn_implementation="sdpa")
    if spec.get("peft"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0,
                                                 **spec["peft"]))
    common = dict(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, max_steps=spec["steps"],
        learning_rate=spec["learning_rate"], weight_decay=spec["weight_decay"],
        lr_scheduler_type="cosine", warmup_steps=spec["warmup_steps"], max_grad_norm=1.0,
        optim="adamw_torch_fused", bf16=spec["precision"] == "bf16",
        use_cpu=spec.get("device", "cpu") == "cpu",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        seed=spec["seed"], train_sampling_strategy="sequential", dataloader_drop_last=True,
        disable_tqdm=True, remove_unused_columns=False, use_liger_kernel=spec.get("liger", False),
        torch_compile=spec.get("compile", False),
    )
    if trl:
        from trl import SFTConfig

        args = SFTConfig(**common, padding_free=True, max_length=None,
                         dataset_kwargs={"skip_prepare_dataset": True})
    else:
        args = TrainingArguments(**common)
    losses: list[float] = []
    slots = {"real": 0, "total": 0}
    per_batch: list[int] = []  # useful tokens of each collated batch (= each step here)
    step_ends: list[float] = []
    cuda = torch.cuda.is_available() and not args.use_cpu

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

    callbacks = [Record()]
    if spec.get("timer"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_timer import hf_timer

        callbacks.append(hf_timer(spec["timer"]["path"], spec["timer"]["boundaries"]))
    if spec.get("profile"):
        callbacks.append(step_profiler(**spec["profile"]))
    if trl:
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                             callbacks=callbacks)
        collator = trainer.data_collator

        def counting_collator(features):
            batch = collator(features)
            real = int((batch["position_ids"] >= 0).sum())  # one unpadded row
            slots["real"] += real
            slots["total"] += batch["input_ids"].numel()
            per_batch.append(real)
            return batch

        trainer.data_collator = counting_collator
    else:
        collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)

        def counting_collator(features):
            batch = collator(features)
            slots["real"] += int(batch["attention_mask"].sum())
            slots["total"] += batch["attention_mask"].numel()
            per_batch.append(int(batch["attention_mask"].sum()))
            return batch

        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          data_collator=counting_collator, callbacks=callbacks)
    started = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - started
    if spec.get("save_dir"):
        trainer.save_model(spec["save_dir"])
    real = slots["real"]  # collated batches = trained batches (max_steps, accumulation 1)
    skip = spec.get("warmup_window", 0)  # steps left out of the timed window
    json.dump({
        # steps skip+1..N: batches skip..N-1, from the end of step `skip` to the end of N
        "window_tokens": sum(per_batch[skip : len(step_ends)]) if skip else real,
        "window_seconds": step_ends[-1] - step_ends[skip - 1] if skip else wall,
        "cuda_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "train_runtime": result.metrics["train_runtime"], "train_wall": wall,
        "useful_tokens": real, "token_slots": slots["total"],
        "padding_fraction": 1 - real / max(slots["total"], 1),
        "losses": losses, "tokens_per_step": per_batch,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pid": os.getpid(),
    }, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
