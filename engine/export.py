"""The export stage's door into the engine: the trained model loaded (merged or with its
adapter) on this machine's device, the base model's config and card facts, the class-name file,
and the quantized copies.

tasks/export.py and the exporters (tasks/exporters) import this module and no other engine
module (tests/test_layering.py), so `finetune validate`, which runs each exporter's check,
reaches the engine through doors only, and a format's engine code moves without an edit to
the stage.
"""

from __future__ import annotations

from engine.modeling.labels import read_labels, write_labels
from engine.modeling.model import (load_model_config, load_tokenizer, load_trained,
                                   resolve_model_ref)
from engine.modeling.quantization import check_convertible, quantized_copy, save_quantized
from engine.process.distributed import choose_device

__all__ = ["check_convertible", "choose_device", "load_model_config", "load_processor",
           "load_tokenizer", "load_trained", "quantized_copy", "read_labels",
           "resolve_model_ref", "save_quantized", "write_labels"]


def load_processor(cfg, tokenizer, root):
    """What the exported folder keeps to encode inputs: the tokenizer, or a vision-language
    model's processor around it (engine.kinds: the model kind's `processor`)."""
    from engine.kinds import kind_of

    return kind_of(cfg).processor(tokenizer, cfg.model, root)
