"""What the engine asks of the model it trains, answered once per architecture family.

A causal LM, an encoder-decoder and a sequence classifier differ in a handful of places: the
batch the model takes (an encoder-decoder's decoder inputs), how labels sit against the logits
(no next-token shift for a decoder's own positions), the loss (one class per row for a
classifier), which run class a method uses for it (SFT of a classifier measures classes, not
text), what the architecture must be once loaded, and where generated text starts in the
output. Each of those is a member here; the loop, the strategies and the stages ask the kind
instead of branching on flags, so a new family (vision-language next: `pixel_values` as a model
input, a processor beside the tokenizer) is one module plus a registry line
(engine.kinds.KINDS), the way torchtitan keeps a model family's pieces in its own folder.

The config side of a kind (the auto class, PEFT's task type, the pipeline tag, the compat
facts) is finetune.datatypes.base.ModelTask, whose `kind` names one of these: the config is
validated before any engine code runs, so those facts cannot live here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from engine.datapath.data import collate, register_model_inputs, user_collate
from engine.modeling.labels import write_labels
from engine.modeling.model import refuse_encoder_decoder
from engine.objective.loss import build_loss


class ModelKind:
    """The causal language model: every member's default is a decoder-only LM's answer."""

    #: the registry key (finetune.datatypes.base.ModelTask.kind names it)
    name = "causal_lm"
    #: batch keys beyond the text ones that go to the model's forward (registered with
    #: engine.datapath.data.model_inputs when the kind's class is defined)
    extra_model_inputs: tuple[str, ...] = ()
    #: those of them whose presence means the labels are the model's own positions (no
    #: next-token shift: engine.datapath.data.label_shift)
    unshifting_inputs: tuple[str, ...] = ()
    #: tokenized columns beyond the method's that its batches are made from (a
    #: vision-language model's pixel values): the data path reads them too
    data_columns: tuple[str, ...] = ()
    #: training.type -> the run class ('module:Class') that trains this kind when the method's
    #: own would measure the wrong thing (SFT of a classifier: classes, not generations)
    run_classes: dict[str, str] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        register_model_inputs(cls.extra_model_inputs, cls.unshifting_inputs)

    # -- what the loaded model must be -------------------------------------------------------

    def check_architecture(self, model_config, source: str) -> None:
        """Refuse, in one line naming `source`, a model whose architecture this kind cannot
        train (an encoder-decoder reached through a folder's config, model_init or a class
        named by path: its labels would be laid out for the wrong model)."""
        refuse_encoder_decoder(model_config, source)

    def prepare_base(self, model, cfg):
        """The loaded base before the adapter goes on: what of it trains (a vision-language
        model's frozen tower) and the adapter section that wraps it (the config's, or one whose
        target modules the kind resolved). A text model's: the config's peft section."""
        return cfg.peft

    # -- inputs ------------------------------------------------------------------------------

    def processor(self, tokenizer, model_cfg, root):
        """What the data stages encode inputs with (finetune.datatypes.base.DataContext): a
        text model's tokenizer; a vision-language kind loads its AutoProcessor around it."""
        return tokenizer

    # -- batches -----------------------------------------------------------------------------

    def train_collate(self, cfg, model, pad_id: int, layout: Callable[[list[dict]], dict]
                      ) -> Callable[[list[dict]], dict]:
        """The training batches: `layout` (the configured padding, packing or padding-free
        collator), or data.collate_fn's when the project names one."""
        ref = cfg.data.user_collate_fn
        return user_collate(ref) if ref else layout

    def eval_collate(self, cfg, model, pad_id: int) -> Callable[[list[dict]], dict]:
        """Evaluation batches: data.collate_fn's when it names one (the held-out loss is
        measured on the batches training saw), else dynamic padding."""
        ref = cfg.data.user_collate_fn
        return user_collate(ref) if ref else functools.partial(collate, pad_id=pad_id)

    # -- loss --------------------------------------------------------------------------------

    def loss(self, model, cfg, device, amp, user_fn=None):
        """The training loss (engine.objective.loss): the user's, else the full or chunked
        next-token cross entropy (probed against the full one)."""
        return build_loss(model, cfg.training.loss_chunk_tokens, device, amp, user_fn=user_fn)

    # -- saved weights -----------------------------------------------------------------------

    def save_beside_weights(self, folder, processor, labels: list[str] | None) -> None:
        """What a trained folder holds besides the weights, so it loads on its own: the
        processor (`processor`: a text model's tokenizer, a vision-language model's processor
        around it) and a head's label map."""
        processor.save_pretrained(folder)
        if labels:
            write_labels(folder, labels)

    # -- generation --------------------------------------------------------------------------

    def prompt_inputs(self, processor, rows, room: int | None, root):
        """The evaluate stage's generation prompts when the kind encodes them itself: (token
        ids per prompt, and None or a function of (prompt indices, left-padded width) giving
        the batch's further model inputs); `rows`: the dataset type's eval rows; `room`: the
        tokens a prompt may keep; `root`: the project (where a row's files are). None: the
        prompts' text, encoded as text (a text model's)."""
        return None

    def generated_from(self, prompt_width: int) -> int:
        """Where the new tokens start in `generate`'s output: after the prompt's columns for a
        decoder-only model."""
        return prompt_width
