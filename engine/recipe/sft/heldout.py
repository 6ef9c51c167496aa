"""A language model's held-out numbers for the evaluate stage: loss and perplexity from the
same tokenized test split and the same token-weighted loss the trainer uses (so "fine-tuned
below base" is an apples-to-apples claim), the QAT-quantized model's loss, and greedy
generations on the first `eval.max_generation_samples` prompts (encoded exactly as in
training), scored by each source's dataset type. Each number that is a mean over rows (or the
token-weighted loss, a ratio of the rows' sums) gets its bootstrap stderr over the rows
(`<metric>_stderr`, eval.bootstrap_samples, engine.evaluation.bootstrap); the loss's only where
a batch row is one example (not under a project's data.collate_fn, which may pack)."""

from __future__ import annotations

from typing import Callable

from engine.evaluation.bootstrap import bootstrap_seed, perplexity, ratio_stderr, stderrs
from engine.evaluation.heldout import Evaluated, HeldOut, evaluate_loss
from engine.kinds import kind_of
from engine.modeling.model import max_positions
from engine.modeling.quantization import conversion_blocker, quantized_copy
from engine.reporting.reporters import work_bar
from engine.rollout.greedy import encode_prompts, greedy_generate
from finetune.errors import PipelineError


def lm_metrics(held: HeldOut, after_loss: Callable[[HeldOut, dict], None] | None = None
               ) -> Evaluated:
    """Base first (its loss and generations), then the fine-tuned model; `after_loss(held,
    results)`: a method's own numbers, added once both losses are in (DPO's pair ranking)."""
    cfg, tok = held.cfg, held.tokenizer
    rows = held.rows()
    # The whole split: eval.eval_batches caps only the quick in-training evals.
    batch = cfg.training.per_device_eval_batch_size
    args = (held.test, batch, tok.pad_token_id)
    # data.collate_fn's, as in training; an encoder-decoder model's own layout
    batches = kind_of(cfg).eval_collate(cfg, held.base, tok.pad_token_id)
    t = cfg.training
    loss_batches = -(-len(held.test) // batch)
    gen_batches = 0 if rows is None else -(-len(rows) // batch)
    total = 2 * (loss_batches + gen_batches) + (loss_batches if t.qat_recipe else 0)
    what = f"loss on {len(held.test)} rows" + (
        "" if rows is None else f", {len(rows)} greedy generations of up to "
        f"{cfg.eval.generation_max_new_tokens} tokens")
    results, generations = {}, {}
    samples_b, seed = cfg.eval.bootstrap_samples, bootstrap_seed(cfg)
    # the stderr resamples examples: only where a batch row is one (the pipeline's collators)
    per_row = bool(samples_b) and cfg.data.user_collate_fn is None

    def measured(model, advance) -> tuple[dict, int]:
        """The loss entry (with its stderrs) and the target tokens it was measured on."""
        result = evaluate_loss(model, *args, collate_fn=batches, on_batch=advance,
                               per_row=per_row)
        return {**loss_entry(result), **loss_stderrs(result, samples_b, seed)}, result["tokens"]

    with work_bar(total, "evaluate", cfg.logging) as advance:
        print(f"[evaluate] base model: {what}", flush=True)
        results["base"], _ = measured(held.base, advance)
        if rows is not None:
            generations["base"] = generate(held, held.base, rows, advance)
        print(f"[evaluate] fine-tuned model: {what}", flush=True)
        tuned = held.tuned()
        results["finetuned"], eval_tokens = measured(tuned, advance)
        if t.qat_recipe:  # the quantised model the export ships (engine.modeling.quantization)
            device = next(tuned.parameters()).device
            reason = conversion_blocker(t.qat_recipe, t.qat_group_size, device)
            if reason:  # QAT trained here; its conversion needs kernels this machine lacks
                print(f"[evaluate] quantized loss not measured: training.qat_recipe "
                      f"{t.qat_recipe} cannot be converted on {device.type} (torchao: {reason})",
                      flush=True)
            else:
                quantized, _ = quantized_copy(tuned, t.qat_recipe, t.qat_group_size)
                results["quantized"], _ = measured(quantized, advance)
                del quantized
        if after_loss is not None:
            after_loss(held, results)
        if rows is not None:
            generations["finetuned"] = generate(held, tuned, rows, advance)
        for name, texts in generations.items():
            scores, per_row_scores = held.scorer.generations(rows, texts)
            results[name].update({k: round(v, 6) for k, v in scores.items()})
            results[name].update(stderrs(per_row_scores, samples_b, seed))
    counts = {"eval_tokens": eval_tokens,
              "generation_rows": 0 if rows is None else len(rows)}
    return Evaluated(results, counts, samples(rows, generations, cfg.eval.num_logged_samples))


def loss_entry(result: dict) -> dict:
    return {"loss": round(result["loss"], 6), "perplexity": round(result["perplexity"], 4)}


def loss_stderrs(result: dict, samples: int, seed: int) -> dict:
    """The loss's and the perplexity's bootstrap stderr over the examples (the token-weighted
    loss is a ratio of sums: the rows' loss sums over their target tokens; the perplexity is
    exp of each resample's loss), when `evaluate_loss` measured per row."""
    if "row_loss_sums" not in result:
        return {}
    sums, counted = result["row_loss_sums"], result["row_tokens"]
    loss = ratio_stderr(sums, counted, samples, seed)
    if loss is None:
        return {}
    return {"loss_stderr": round(loss, 6),
            "perplexity_stderr": round(ratio_stderr(sums, counted, samples, seed,
                                                    transform=perplexity), 4)}


def generate(held: HeldOut, model, rows, on_batch: Callable[[], None] | None = None
             ) -> list[str]:
    prompts, extras = generation_inputs(held.cfg, held.root, held.tokenizer, rows)
    return greedy_generate(model, held.tokenizer, prompts,
                           held.cfg.training.per_device_eval_batch_size,
                           held.cfg.eval.generation_max_new_tokens, on_batch=on_batch,
                           generated_from=kind_of(held.cfg).generated_from, extras=extras)


def generation_inputs(cfg, root, tok, rows) -> tuple[list[list[int]], Callable | None]:
    """The generation rows' prompts as the model kind encodes them (as in training; too long
    ones keep their end, leaving eval.generation_max_new_tokens of the model's positions),
    and the kind's further inputs (a vision-language model's images), or None: what
    `greedy_generate` takes, for the evaluate stage and in-training evaluation alike."""
    ev = cfg.eval
    limit = max_positions(cfg.model, root)
    room = limit - ev.generation_max_new_tokens if limit else None
    if room is not None and room < 1:
        raise PipelineError(
            f"eval.generation_max_new_tokens {ev.generation_max_new_tokens} leaves no room for "
            f"a prompt in the model's {limit} positions; lower it"
        )
    kind = kind_of(cfg)
    processor = kind.processor(tok, cfg.model, root)
    return kind.prompt_inputs(processor, rows, room, root) or (
        encode_prompts(tok, rows["prompt"].tolist(), room), None)


def samples(rows, generations: dict[str, list[str]], n: int) -> list[dict]:
    """The first n rows side by side: what a reviewer reads before trusting a number."""
    if rows is None or n == 0:
        return []
    head = rows.head(n)
    return [
        {"prompt": prompt, "reference": reference,
         "generation": generations["finetuned"][i], "base_generation": generations["base"][i]}
        for i, (prompt, reference) in enumerate(zip(head["prompt"], head["reference"]))
    ]
