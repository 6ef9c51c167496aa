"""A trained reward model as one of the reward functions (engine.rollout.rewards; in
`grpo.reward_funcs`: a directory path, or a registered model the train and evaluate stages
resolved to one: tasks.model_refs).

The model is a one-output sequence classifier with its tokenizer, what
`AutoModelForSequenceClassification` loads (an HF directory, or the transformers-flavour folder
MLflow's registry hands back: `model/` and `components/tokenizer/`). It is loaded once per run
on the run's device, in eval mode, and scores a batch of completions without gradients, in
chunks, each prompt and completion rendered as a reward model trained here on `preference`
pairs saw them (finetune.datatypes.preference): BOS where the tokenizer adds one; a string
prompt's tokens, the completion's, then EOS; a conversation through the reward model's
tokenizer's chat template, the prompt turns with the generation prompt, then what the whole
conversation (the prompt turns and the assistant completion) adds after them, as TRL's
GRPOTrainer renders it for a reward model. The score is the model's one logit, read where
transformers' sequence classifiers read it (the last token that is not padding), as TRL does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from finetune.errors import PipelineError

#: files that make a folder a tokenizer's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def model_files(directory: Path) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) of a reward model directory: the same for an HF
    directory; MLflow's transformers flavour (an MLmodel file) keeps them apart."""
    if (directory / "MLmodel").exists() and (directory / "model").is_dir():
        tokenizer = directory / "components" / "tokenizer"
        return directory / "model", tokenizer if tokenizer.is_dir() else directory / "model"
    return directory, directory


def check_reward_model(root: Path, ref: str, key: str) -> Path:
    """The reward model directory `ref` (relative to `root`); one line naming `key` and `ref`
    unless it holds a one-output sequence classifier and its tokenizer (read from config.json
    and the file names: no weights are loaded)."""
    directory = Path(root) / ref
    if not directory.is_dir():
        raise PipelineError(f"{key}: reward model directory {ref} not found (a folder "
                            "AutoModelForSequenceClassification loads, with its tokenizer)")
    model_dir, tokenizer_dir = model_files(directory)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise PipelineError(f"{key}: {ref} has no config.json: not a model directory")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise PipelineError(
            f"{key}: {ref} is not a reward model (a sequence classifier with one output); its "
            f"config's architectures: {architectures or 'none'}")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)  # HF: 2
    if labels != 1:
        raise PipelineError(f"{key}: {ref} is a sequence classifier with {labels} outputs; a "
                            "reward model has one (num_labels 1)")
    if not any((tokenizer_dir / f).exists() for f in TOKENIZER_FILES):
        raise PipelineError(f"{key}: {ref} has no tokenizer (save it next to the model)")
    return directory


class RewardModel:
    """A reward model called as TRL calls a reward function: one score per completion."""

    def __init__(self, directory: Path, name: str, device: torch.device, batch_size: int):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from finetune.datatypes.encoding import bos_prefix_id

        model_dir, tokenizer_dir = model_files(directory)
        self.__name__ = name  # the metrics' name (rewards.callable_name)
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        if self.tok.pad_token is None:  # as the reward run and TRL pad: with EOS
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype="auto").to(device).eval().requires_grad_(False)
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.bos = bos_prefix_id(self.tok)
        self.device, self.batch_size = device, batch_size

    def token_ids(self, prompt: Any, completion: Any) -> list[int]:
        """The ids the reward model scores for one prompt and completion."""
        from finetune.datatypes.encoding import token_ids

        if isinstance(prompt, str):
            head, body = token_ids(self.tok, [prompt, str(completion)])  # a string prompt's
            # completion is a string (engine.rollout.scoring.score_completions)
            tail = [self.tok.eos_token_id]
        else:
            if self.tok.chat_template is None:
                raise PipelineError("the reward model's tokenizer has no chat template to "
                                    "render conversational prompts with")
            turns = list(prompt) + (list(completion) if isinstance(completion, list) else
                                    [{"role": "assistant", "content": completion}])
            first = self.tok.apply_chat_template(list(prompt), tokenize=False,
                                                 add_generation_prompt=True)
            full = self.tok.apply_chat_template(turns, tokenize=False)
            if self.tok.bos_token and self.bos is not None and first.startswith(
                    self.tok.bos_token):  # BOS is added as a token below
                first, full = first[len(self.tok.bos_token):], full[len(self.tok.bos_token):]
            if full.startswith(first):
                head, body = token_ids(self.tok, [first, full[len(first):]])
            else:  # a template that renders the prompt turns otherwise in a whole conversation
                head, body = [], token_ids(self.tok, [full])[0]
            tail = []
        return ([self.bos] if self.bos is not None else []) + head + body + tail

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        rows = [self.token_ids(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            longest = max(map(len, chunk))
            ids = torch.full((len(chunk), longest), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(chunk):  # right padding, as TRL's reward batch
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            logits = self.model(input_ids=ids.to(self.device),
                                attention_mask=mask.to(self.device)).logits
            scores.append(logits[:, 0].float())
        return torch.cat(scores).tolist() if scores else []  # one host sync per batch

