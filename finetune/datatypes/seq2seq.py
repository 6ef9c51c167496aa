"""`seq2seq`: the `completion` type's prompt/completion rows for an encoder-decoder model
(T5-style, `AutoModelForSeq2SeqLM`, peft task SEQ_2_SEQ_LM): the prompt is the encoder's input
and the completion (and its EOS) the decoder's labels, each its own length, every label trained.
The batching, the loss and generation follow from the type's model task
(`ModelTask.encoder_decoder`); the templates and functions are the completion type's.
"""

from __future__ import annotations

from finetune.datatypes.base import SEQ_2_SEQ_LM, DataContext
from finetune.datatypes.completion import CompletionType
from finetune.datatypes.encoding import IGNORE_INDEX, empty_encoding, token_ids


class Seq2SeqType(CompletionType):
    name = "seq2seq"
    aliases = ()
    task = SEQ_2_SEQ_LM
    untrainable = "completion empty"
    labels_aligned = False  # the labels are the decoder's own sequence

    def check(self) -> None:
        super().check()
        if self.plain_text:
            raise ValueError("seq2seq needs a prompt and a completion (prompt_template/"
                             "prompt_func and completion_template/completion_func): the "
                             "encoder reads one, the decoder learns the other")

    def encoder(self, ctx: DataContext):
        return encode_seq2seq, {"bos": ctx.bos, "max_len": self.data.max_seq_length}


def encode_seq2seq(batch: dict[str, list], tok, bos: int | None, max_len: int
                   ) -> dict[str, list]:
    """input_ids: the prompt (encoded as generation prompts are); labels: the completion and
    EOS. Each is cut to `max_len` on its own; `truncated` says either was."""
    n = len(batch["prompt"])
    ids_of = token_ids(tok, list(batch["prompt"]) + list(batch["completion"]))
    out = empty_encoding()
    for p, c in zip(ids_of[:n], ids_of[n:]):
        ids, labels = ([bos] if bos is not None else []) + p, c + [tok.eos_token_id]
        out["truncated"].append(len(ids) > max_len or len(labels) > max_len)
        out["input_ids"].append(ids[:max_len])
        out["labels"].append(labels[:max_len])
        out["n_trainable"].append(sum(1 for x in labels[:max_len] if x != IGNORE_INDEX))
    return out
