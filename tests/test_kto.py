"""KTO (training.type kto, data.dataset_type unpaired_preference): the loss and the logged
statistics against TRL's KTOTrainer (the oracle), the rows as the type makes them, and the
run's guarantees (DDP, resume) as the SFT run has them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT
from test_preference import CHAT_TEMPLATE, STRING_ROWS, _models, _tokenizer

#: labelled completions: each pair's chosen side desirable, its rejected side not, one row each
#: (a batch of 6 with both labels, rows of different lengths)
STRING_ROWS_KTO = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                   for r in STRING_ROWS for side in ("chosen", "rejected")]
CHAT_ROWS_KTO = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                  "completion": [{"role": "assistant", "content": r["completion"].strip()}],
                  "label": r["label"]} for r in STRING_ROWS_KTO]


def _encode(rows: list[dict], chat: bool) -> tuple[list[dict], pd.DataFrame]:
    """The rows as the unpaired_preference type formats and tokenizes them."""
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    data = DataConfig(dataset_type="unpaired_preference", data_files={"train": "x.jsonl"},
                      chat_template=CHAT_TEMPLATE if chat else None)
    tok = _tokenizer()
    ctx = DataContext(ROOT, lambda: tok)
    formatted = data.datatype.format(pd.DataFrame(rows), "train", ctx)
    assert formatted.dropped == []
    fn, kwargs = data.datatype.encoder(ctx)
    enc = fn(formatted.rows.to_dict("list"), tok=tok, **kwargs)
    keys = ("input_ids", "labels", "desirable")
    return [dict(zip(keys, values)) for values in zip(*(enc[k] for k in keys))], formatted.rows


def _ours(policy, ref, rows: list[dict], kto) -> tuple[float, dict]:
    """Our loss and logged statistics of one step on `rows`, as the run computes them."""
    from engine.datapath.data import collate
    from engine.objective.logprobs import sequence_logps
    from engine.recipe.kto.batches import collate_unpaired, mismatched
    from engine.recipe.kto.loss import SUMS, clamped_mean, kl_estimate, kto_loss, window_means

    tok = _tokenizer()
    batch = collate_unpaired(rows, lambda r: collate(r, tok.pad_token_id), max_len=512)

    def logps(model, b):
        return sequence_logps(model(input_ids=b["input_ids"],
                                    attention_mask=b["attention_mask"]).logits, b["labels"])[0]

    with torch.no_grad():
        kl = clamped_mean(kl_estimate(logps(policy, mismatched(batch)),
                                      logps(ref, mismatched(batch))))
        ref_logps = logps(ref, batch)
    out = kto_loss(kto, logps(policy, batch), ref_logps, batch["desirable"], kl)
    return float(out.losses.mean().detach()), window_means(dict(zip(SUMS, out.sums().tolist())))


def _trl_kto(tmp_path, policy, ref, rows: list[dict], **config) -> tuple[float, dict]:
    """TRL's KTOTrainer loss on the same token ids in its layout (prompt / completion split at
    the label mask; the KL completions rotated by one within the batch, as its dataset map
    does), collated by its own collator."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(rows), **config)
    trainer = KTOTrainer(model=policy, ref_model=ref, args=args, processing_class=_tokenizer(),
                         train_dataset=Dataset.from_list(STRING_ROWS_KTO))
    examples = []
    for r in rows:
        start = next(i for i, x in enumerate(r["labels"]) if x != -100)
        examples.append({"prompt_ids": r["input_ids"][:start],
                         "completion_ids": r["input_ids"][start:], "label": bool(r["desirable"])})
    for example, previous in zip(examples, examples[-1:] + examples[:-1]):
        example["KL_completion_ids"] = previous["completion_ids"]
    policy.train()
    loss = trainer._compute_loss(policy, trainer.data_collator(examples), return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("chat", [False, True], ids=["strings", "conversational"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.3, 0.7)], ids=["even", "weighted"])
def test_loss_and_statistics_equal_trls(tmp_path, chat, weights):
    from finetune.config.kto import KTOConfig

    rows, _ = _encode(CHAT_ROWS_KTO if chat else STRING_ROWS_KTO, chat)
    # the perturbed copy as the reference: the real model finds text likelier, so the KL
    # estimate is above 0 and not clamped away (the other way round it is clamped to 0)
    ref, policy = _models()
    kto = KTOConfig(beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    ours, stats = _ours(policy, ref, rows, kto)
    theirs, trl_stats = _trl_kto(tmp_path, policy, ref, rows, beta=0.3,
                                 desirable_weight=weights[0], undesirable_weight=weights[1])
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert stats["kl"] > 0  # the perturbed policy: the clamp does not hide the estimate
    assert set(stats) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                          "logps/chosen", "logps/rejected", "kl"}
    for name, value in stats.items():
        assert abs(value - trl_stats[name]) < 1e-5 * max(1.0, abs(value)), name
