"""The model kinds (engine.kinds.base.ModelKind): one per architecture family, looked up once
per run from the config's ModelTask (finetune.datatypes.base), which names its kind. A new
family is one module here plus one line in KINDS; a project's own kind is named as
'module:Class' by its dataset type's or method's ModelTask."""

from __future__ import annotations

from finetune.errors import PipelineError
from finetune.registry import Registry

#: ModelTask.kind -> the kind's class, imported only when a run trains one
KINDS = Registry("model kind", "model kind", base="engine.kinds.base:ModelKind",
                 built_ins={"causal_lm": "engine.kinds.causal_lm:CausalLM",
                            "seq2seq_lm": "engine.kinds.seq2seq_lm:Seq2SeqLM",
                            "sequence_classifier": "engine.kinds.classifier:SequenceClassifier",
                            "image_text_to_text":
                                "engine.kinds.image_text_to_text:ImageTextToText"})


def kind_of(cfg):
    """The kind of model `cfg` (a FinetuneConfig) trains: its ModelTask's, which the method
    names when it chooses the model (a reward head), else the dataset type. A kind that does
    not resolve is one line naming the key that chose it."""
    from finetune.config.methods import method_of

    try:
        return KINDS.get(cfg.model_task.kind)()
    except PipelineError as exc:
        chosen_by = (f"training.type {cfg.training.type}" if method_of(cfg.training.type).task
                     else f"data.dataset_type {cfg.data.dataset_type}")
        raise PipelineError(f"{chosen_by}: {exc}") from None
