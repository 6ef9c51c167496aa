"""The `model` and `peft` sections: what to load (`from_pretrained` arguments, tokenizer and
vocabulary) and the adapter around it. engine/modeling/model.py consumes them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, field_validator, model_validator

from finetune.config import compat
from finetune.config.compat import META, PIPELINE, QUANTIZED, Needs, Refuse, When, add_rows
from finetune.config.section import Field, Section

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token", "additional_special_tokens")


class ModelConfig(Section):
    """What to load and how (`from_pretrained` arguments)."""

    name_or_path: str = Field(
        "data/models/stories260K", fingerprint=False,
        description="Hub model id or local folder (relative paths resolve against the project root).",
    )
    auto_class_name: str = Field(
        "AutoModelForCausalLM", fingerprint=True,
        description="Class that loads the model: a transformers AutoModel name, a key "
        "registered with engine.modeling.model.register_model_class, or 'module:Class'.",
        pattern=r"^[A-Za-z_][\w.\-]*(:[A-Za-z_]\w*)?$",
    )
    revision: str | None = Field(
        None, fingerprint=False, description="Hub revision (branch, tag or commit) to pin.")
    # fingerprinted: the base-model hash covers every weights file in the folder, so only
    # this key tells which of them (a .gguf or the safetensors beside it) the run trained from
    gguf_file: str | None = Field(
        None, fingerprint=True,
        description="A GGUF file in name_or_path (a local folder or hub repo) to load as the "
        "base model, for any training type (transformers' gguf_file). The tokenizer comes from "
        "the same file unless tokenizer_name_or_path is set; quantized GGUF types (Q8_0, "
        "Q4_K, ...) are dequantized to model.dtype on load, so training sees a dense model.",
    )
    model_init: str | None = Field(
        None, fingerprint=True, code_ref=True,
        description="'module:function' with no arguments returning the base model (a "
        "transformers PreTrainedModel), used instead of from_pretrained (HF Trainer's model_init, without the trial argument); it runs "
        "after the seed is set, so the same params build the same model in every stage. The "
        "tokenizer still comes from name_or_path (or tokenizer_name_or_path).",
    )
    tokenizer_name_or_path: str | None = Field(
        None, fingerprint=True,
        validation_alias=AliasChoices("tokenizer_name_or_path", "tokenizer_name"),
        description="A tokenizer other than the model's (hub id or local folder); None: the "
        "model's. Alias: tokenizer_name, also as data.tokenizer_name (QEfficient's place for it). Saved "
        "with the trained and exported model.",
    )
    added_tokens: list[str] = Field(
        fingerprint=True, default_factory=list,
        description="New tokens added to the vocabulary (tokenizer.add_tokens); the embeddings "
        "grow to match (new rows: the mean of the old ones) and, with an adapter, the new "
        "rows train (peft.trainable_token_indices).",
    )
    special_tokens: dict[str, str | list[str]] = Field(
        fingerprint=True, default_factory=dict,
        description="Special tokens to set or add (tokenizer.add_special_tokens): pad_token, "
        "eos_token, bos_token, unk_token, sep_token, cls_token, mask_token, "
        "additional_special_tokens (a list). A new token grows the vocabulary as added_tokens "
        "does.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", fingerprint=True, description="Dtype the weights are loaded in."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", fingerprint=False, description="Attention kernel passed to from_pretrained."
    )
    use_cache: bool = Field(
        False, fingerprint=False, description="KV cache during training (off: saves memory).")
    device_map: str | None = Field(
        None, fingerprint=False, description="device_map for from_pretrained (e.g. 'cpu').")
    load_in_4bit: bool = Field(
        False, fingerprint=True, description="QLoRA 4-bit loading via bitsandbytes (CUDA only).")
    load_in_8bit: bool = Field(
        False, fingerprint=True, description="8-bit loading via bitsandbytes (CUDA only).")
    trust_remote_code: bool = Field(
        False, fingerprint=False, description="Allow model code from the hub repo to run.")
    freeze_vision_tower: bool = Field(
        True, fingerprint=True,
        description="A vision-language model (data.dataset_type vision_chat): its vision "
        "tower does not train (full fine-tuning: frozen; LoRA: peft.target_modules all-linear "
        "leaves it out). LLaMA-Factory's name; ms-swift's freeze_vit.")
    freeze_projector: bool = Field(
        True, fingerprint=True,
        description="A vision-language model: the projector between the vision tower and the "
        "language model (LLaVA's multi_modal_projector, Qwen2-VL's merger) does not train, as "
        "freeze_vision_tower. LLaMA-Factory's freeze_multi_modal_projector; ms-swift's "
        "freeze_aligner.")

    @field_validator("special_tokens")
    @classmethod
    def _known_special_tokens(cls, tokens: dict) -> dict:
        for key, value in tokens.items():
            if key not in SPECIAL_TOKEN_KEYS:
                raise ValueError(f"'{key}' is not a special token name (one of "
                                 f"{', '.join(SPECIAL_TOKEN_KEYS)})")
            if (key == "additional_special_tokens") != isinstance(value, list):
                raise ValueError(f"{key}: " + ("a list of tokens" if isinstance(value, str)
                                               else "one token (a string)"))
        return tokens

    @model_validator(mode="after")
    def _compat(self) -> "ModelConfig":
        compat.check(self, "model")
        return self


#: peft's named initialisations besides true/false and pissa_niter_N
INIT_LORA_WEIGHTS = ("gaussian", "pissa", "olora")


class PeftSection(Section):
    """Parameter-efficient fine-tuning (peft.LoraConfig / peft.IA3Config names)."""

    use_peft: bool = Field(
        True, fingerprint=True, description="Train an adapter; false = full fine-tuning.")
    peft_type: Literal["LORA", "IA3"] = Field("LORA", fingerprint=True, description="Adapter kind.")
    r: int = Field(8, fingerprint=True, gt=0, description="LoRA rank.")
    lora_alpha: float = Field(
        16, fingerprint=True, gt=0, description="LoRA scaling numerator (alpha / r).")
    lora_dropout: float = Field(
        0.0, fingerprint=True, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", fingerprint=True, description="Module names to adapt, or 'all-linear'."
    )
    feedforward_modules: list[str] | None = Field(
        None, fingerprint=True,
        description="IA3 only: which target modules are feed-forward layers."
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", fingerprint=True, description="Which biases train.")
    # peft.LoraConfig's own names and defaults (the default run's adapter is unchanged);
    # rules among them and other keys: finetune/config/compat.py
    use_dora: bool = Field(
        False, fingerprint=True,
        description="LoRA only: DoRA (weight-decomposed LoRA: a trained magnitude per output).")
    use_rslora: bool = Field(
        False, fingerprint=True,
        description="LoRA only: rank-stabilized scaling, lora_alpha / sqrt(r) instead of / r.")
    init_lora_weights: bool | str = Field(
        True, fingerprint=True,
        description="LoRA only: how the adapter starts. true (B = 0), false (random, for "
        "tests), gaussian, pissa or pissa_niter_N (the principal singular vectors, N "
        "randomized-SVD iterations seeded from training.seed), olora (QR); loftq is refused "
        "(its adapter belongs to a quantized base). pissa and olora move part of the base weights into the adapter; the "
        "saved adapter is converted to apply to the original base.")
    layers_to_transform: int | list[int] | None = Field(
        None, fingerprint=True,
        description="LoRA only: adapt only these layer indices (needs target_modules as a list).")
    layers_pattern: str | list[str] | None = Field(
        None, fingerprint=True,
        description="LoRA only: the name of the layer list layers_to_transform indexes "
        "(e.g. layers); null: peft's usual names.")
    rank_pattern: dict[str, int] = Field(
        fingerprint=True, default_factory=dict,
        description="LoRA only: r per module name or regex (peft's rank_pattern).")
    alpha_pattern: dict[str, float] = Field(
        fingerprint=True, default_factory=dict,
        description="LoRA only: lora_alpha per module name or regex (peft's alpha_pattern).")
    modules_to_save: list[str] | None = Field(
        None, fingerprint=True,
        description="Modules trained in full and saved with the adapter (with a grown "
        "vocabulary, the embedding layers join them).")
    target_parameters: list[str] | None = Field(
        None, fingerprint=True,
        description="LoRA only: nn.Parameter weights to adapt by name (e.g. MoE experts' "
        "mlp.experts.gate_up_proj), beside target_modules.")
    task_type: Literal["CAUSAL_LM", "SEQ_CLS", "SEQ_2_SEQ_LM"] = Field(
        "CAUSAL_LM", fingerprint=True,
        description="peft task type (SEQ_CLS, set for data.dataset_type "
        "classification, also trains the classification head: modules_to_save; SEQ_2_SEQ_LM, "
        "set for data.dataset_type seq2seq: an encoder-decoder model, T5-style).")

    @field_validator("init_lora_weights")
    @classmethod
    def _known_init(cls, value: bool | str) -> bool | str:
        import re

        if value == "loftq":
            raise ValueError(
                "loftq: peft's LoftQ quantizes with bitsandbytes on a CUDA GPU (it has no "
                "CPU quantizer), and its adapter belongs to the quantized base it writes, not "
                "to the original base the evaluate and export stages load; use pissa (an SVD "
                "start too, saved as an adapter of the original base)")
        if isinstance(value, bool) or value in INIT_LORA_WEIGHTS or re.fullmatch(
                r"pissa_niter_[1-9]\d*", value):
            return value
        raise ValueError(f"'{value}' is not a LoRA initialisation (true, false, "
                         f"{', '.join(INIT_LORA_WEIGHTS)} or pissa_niter_N)")

    @field_validator("rank_pattern", "alpha_pattern")
    @classmethod
    def _positive(cls, pattern: dict) -> dict:
        for key, value in pattern.items():
            if value <= 0:
                raise ValueError(f"{key}: {value} (must be > 0)")
        return pattern

    @property
    def mutates_base(self) -> bool:
        """PiSSA and OLoRA rewrite the base weights when the adapter is made."""
        init = self.init_lora_weights
        return isinstance(init, str) and (init.startswith("pissa") or init == "olora")

    trainable_token_indices: Literal["added"] | list[int] | dict[str, list[int]] | None = Field(
        "added", fingerprint=True,
        description="LoRA: which embedding rows train on their own (peft's trainable tokens; "
        "the rest of the embedding stays frozen). 'added': the rows model.added_tokens and "
        "model.special_tokens add (none added: none train), in the input embedding and "
        "the output layer; a list of token ids (the input embedding) or {module name: "
        "[ids]}; null: a grown vocabulary's embedding and output layers train in full "
        "(modules_to_save), as IA3 and full fine-tuning always do.")

    @field_validator("trainable_token_indices")
    @classmethod
    def _token_ids(cls, value):
        lists = value.values() if isinstance(value, dict) else [value] if isinstance(
            value, list) else []
        for ids in lists:
            if not ids:
                raise ValueError("an empty list of token ids trains nothing; give ids or null")
            if min(ids) < 0:
                raise ValueError(f"token id {min(ids)} is negative")
        return value


# -- peft's rows of the compatibility table (finetune/config/compat.py), beside its section --

IA3 = When("peft.peft_type IA3", lambda c: c.peft.use_peft and c.peft.peft_type == "IA3")
IA3_EXAMPLE = {"peft.peft_type": "IA3", "peft.target_modules": ["k_proj", "down_proj"],
               "peft.feedforward_modules": ["down_proj"]}
PARAMETER_TARGETS = When("peft.target_parameters", lambda c: bool(c.peft.target_parameters))


def _init_kind(c) -> str | None:
    """The base-rewriting LoRA initialisation a config uses (pissa_niter_N is pissa)."""
    init = c.peft.init_lora_weights
    if not (c.peft.use_peft and c.peft.peft_type == "LORA" and isinstance(init, str)):
        return None
    return "pissa" if init.startswith("pissa") else init


add_rows("peft", [
    *(Refuse("config", f"peft.{key}", IA3,
             "it is a LoRA option; peft's IA3Config has none; use peft.peft_type LORA",
             used=used, example={**IA3_EXAMPLE, f"peft.{key}": value})
      for key, used, value in (
        ("use_dora", None, True), ("use_rslora", None, True),
        ("init_lora_weights", lambda c: c.peft.init_lora_weights is not True, "gaussian"),
        ("layers_to_transform", lambda c: c.peft.layers_to_transform is not None, 1),
        ("rank_pattern", None, {"q_proj": 2}),
        ("alpha_pattern", None, {"q_proj": 2.0}),
        ("target_parameters", None, ["mlp.experts.down_proj"]))),
    Refuse("config", "peft.layers_to_transform",
           When("peft.target_modules a string ('all-linear' or a regex)",
                lambda c: isinstance(c.peft.target_modules, str)),
           "peft picks layers among named modules only; list them (e.g. [q_proj, v_proj])",
           used=lambda c: c.peft.layers_to_transform is not None,
           example={"peft.layers_to_transform": [0]}),
    Needs("config", "peft.layers_pattern",
          When("peft.layers_to_transform", lambda c: c.peft.layers_to_transform is not None),
          "it names the layer list that layers_to_transform indexes",
          example={"peft.layers_pattern": "layers", "peft.target_modules": ["q_proj"]}),
    *(Refuse("config", "peft.init_lora_weights", where, why,
             used=lambda c, kinds=kinds: _init_kind(c) in kinds,
             example={"peft.init_lora_weights": value, **extra})
      for kinds, value, where, why, extra in (
        (("pissa",), "pissa", QUANTIZED,
         "peft converts PiSSA to an adapter of the original base exactly only over float "
         "weights (Quant(W_res) + AB != Quant(W) + dW); load the base unquantized",
         {"model.load_in_4bit": True}),
        (("olora",), "olora", QUANTIZED,
         "peft's OLoRA decomposes float weights only; load the base unquantized",
         {"model.load_in_4bit": True}),
        (("pissa", "olora"), "pissa", META,
         "it rewrites the base weights when the adapter is made, and on meta they are read "
         "after it; use construct_model_on: default or device", {
             "training.construct_model_on": "meta"}),
        (("pissa", "olora"), "olora", PIPELINE,
         "the pipeline writes each stage's adapter weights itself, past peft's conversion "
         "of the adapter to the original base", {"distributed.strategy": "pipeline",
                                                 "distributed.nproc_per_node": 2}),
        *(((("pissa", "olora"), "olora", where,
            "peft converts the adapter to one of the original base (path_initial_model_for_"
            f"weight_conversion) from lora_A and lora_B alone: {lost} would be lost", extra))
          for where, lost, extra in (
            (When("peft.use_dora", lambda c: c.peft.use_dora), "DoRA's magnitudes",
             {"peft.use_dora": True}),
            (When("peft.bias all or lora_only", lambda c: c.peft.bias != "none"),
             "the trained biases", {"peft.bias": "lora_only"}),
            (When("peft.modules_to_save or a classification dataset",
                  lambda c: bool(c.peft.modules_to_save) or c.data.task.classifier),
             "the modules trained in full", {"peft.modules_to_save": ["lm_head"]}))),
        (("pissa", "olora"), "pissa", PARAMETER_TARGETS,
         "a parameter target (peft's ParamWrapper) has no weight matrix to decompose",
         {"peft.target_parameters": ["model.layers.0.mlp.down_proj.weight"]}),
    )),
    Refuse("config", "peft.use_rslora",
           When("peft.rank_pattern or peft.alpha_pattern with init_lora_weights pissa or olora",
                lambda c: bool(c.peft.rank_pattern or c.peft.alpha_pattern)
                and _init_kind(c) in ("pissa", "olora")),
           "peft cannot convert that adapter to one of the original base "
           "(save_pretrained's path_initial_model_for_weight_conversion)",
           example={"peft.use_rslora": True, "peft.init_lora_weights": "pissa",
                    "peft.rank_pattern": {"q_proj": 4}}),
    *(Refuse("config", key, PARAMETER_TARGETS,
             f"peft's ParamWrapper (LoRA on a parameter) does not work with {said}",
             used=used, example={"peft.target_parameters": ["model.layers.0.mlp.down_proj.weight"],
                                 **extra})
      for key, used, said, extra in (
        ("peft.use_dora", None, "DoRA", {"peft.use_dora": True}),
        ("peft.lora_dropout", None, "lora_dropout != 0", {"peft.lora_dropout": 0.1}),
    )),
])
