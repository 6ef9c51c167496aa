"""The model kinds (engine.kinds.base.ModelKind): one per architecture family, looked up once
per run from the config's ModelTask (finetune.datatypes.base), which names its kind. A new
family is one module here plus one line in KINDS; a project's own kind is named as
'module:Class' by its dataset type's or method's ModelTask."""

from __future__ import annotations

from finetune.registry import Registry

#: ModelTask.kind -> the kind's class, imported only when a run trains one
KINDS = Registry("model kind", "model kind", base="engine.kinds.base:ModelKind",
                 built_ins={"causal_lm": "engine.kinds.causal_lm:CausalLM",
                            "seq2seq_lm": "engine.kinds.seq2seq_lm:Seq2SeqLM",
                            "sequence_classifier": "engine.kinds.classifier:SequenceClassifier"})


def kind_of(cfg):
    """The kind of model `cfg` (a FinetuneConfig) trains: its ModelTask's."""
    return KINDS.get(cfg.model_task.kind)()
