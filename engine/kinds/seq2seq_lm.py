"""An encoder-decoder model (T5-style, transformers' AutoModelForSeq2SeqLM): the prompt goes
to the encoder, the completion is the decoder's, and each label is the decoder's own position
(no next-token shift). Its batches carry the decoder's inputs (the labels shifted right behind
the model's decoder_start_token_id), which is what a T5-style model builds from `labels=`
itself; the config rows (finetune.config.compat, ENCODER_DECODER) leave it no other layout."""

from __future__ import annotations

import functools

import torch

from engine.datapath.data import IGNORE_INDEX, collate, round_up, token_loss_sum
from engine.kinds.base import ModelKind
from engine.modeling.model import base_model
from engine.objective.loss import FullLoss, UserLoss
from finetune.errors import PipelineError

DECODER_INPUTS = ("decoder_input_ids",)


def collate_seq2seq(rows: list[dict], pad_id: int, start_id: int, multiple: int | None = None
                    ) -> dict[str, torch.Tensor]:
    """The prompts (input_ids, attention_mask) and the completions (labels, IGNORE_INDEX after
    each row's end) padded each to their own longest row, and the decoder's inputs: the labels
    shifted right behind `start_id`, padding as pad_id."""
    batch = collate([{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in rows],
                    pad_id, multiple)
    longest = round_up(max(len(r["labels"]) for r in rows), multiple)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        labels[i, :len(r["labels"])] = torch.as_tensor(r["labels"])
    decoder = torch.cat([torch.full((len(rows), 1), start_id, dtype=torch.long),
                         labels[:, :-1]], dim=1)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "labels": labels, "decoder_input_ids": decoder.masked_fill(decoder == IGNORE_INDEX,
                                                                        pad_id)}


class Seq2SeqLoss(FullLoss):
    """An encoder-decoder model's logits are the decoder's positions, one per label: the same
    summed cross entropy without the next-token shift (what T5's own `labels=` loss sums)."""

    name = "seq2seq"
    eval_loss_sum = staticmethod(functools.partial(token_loss_sum, shift=0))

    def loss_sum(self, output, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(output.logits, labels, shift=0)


def decoder_start(cfg, model) -> int:
    """The decoder_start_token_id the batches begin the decoder with. `model`: maybe
    PEFT-wrapped (not strategy-wrapped)."""
    start = getattr(base_model(model).config, "decoder_start_token_id", None)
    if start is None:
        raise PipelineError(f"model.name_or_path {cfg.model.name_or_path}: its config has no "
                            "decoder_start_token_id, which an encoder-decoder model's decoder "
                            "starts from; set it in config.json")
    return start


class Seq2SeqLM(ModelKind):
    name = "seq2seq_lm"
    extra_model_inputs = DECODER_INPUTS
    unshifting_inputs = DECODER_INPUTS

    def check_architecture(self, model_config, source: str) -> None:
        if not getattr(model_config, "is_encoder_decoder", False):
            raise PipelineError(f"{source}: data.dataset_type seq2seq trains an encoder-decoder "
                                "model (T5-style); this one is decoder-only: use "
                                "data.dataset_type completion")

    def train_collate(self, cfg, model, pad_id, layout):
        return functools.partial(collate_seq2seq, pad_id=pad_id,
                                 start_id=decoder_start(cfg, model),
                                 multiple=cfg.training.pad_to_multiple_of)

    def eval_collate(self, cfg, model, pad_id):
        return functools.partial(collate_seq2seq, pad_id=pad_id,
                                 start_id=decoder_start(cfg, model))

    def loss(self, model, cfg, device, amp, user_fn=None):
        return UserLoss(user_fn) if user_fn is not None else Seq2SeqLoss()

    def generated_from(self, prompt_width: int) -> int:
        """The decoder's output starts with its start token, not the prompt."""
        return 1
