"""Model and tokenizer loading: the only place `from_pretrained` is called (the adapter is
engine/modeling/adapter.py, a classifier's labels engine/modeling/labels.py, new tokens engine/modeling/vocabulary.py,
a GGUF base's arguments and clean-up engine/modeling/gguf_base.py).

A model reference is a local folder when it exists under the project root (or is written as a
path), otherwise a hub id. Hub failures are turned into one line that explains HF_HUB_OFFLINE
and what to do, instead of a 40-line traceback from huggingface_hub.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from engine.modeling.gguf_base import as_dense_model, dense_load_kwargs, gguf_argument
from engine.modeling.labels import classifier_kwargs, read_labels
from engine.modeling.vocabulary import grow_vocabulary
from finetune.config.model import ModelConfig, PeftSection
from finetune.datatypes.base import SEQ_2_SEQ_LM
from finetune.errors import PipelineError, hub_unreachable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_ref(name: str, root: Path) -> str:
    local = Path(name).expanduser()
    local = local if local.is_absolute() else root / local
    if local.exists():
        return str(local)
    # a hub id is 'name' or 'namespace/name': more path than that is a folder
    if name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name or name.count("/") > 1:
        raise PipelineError(f"model.name_or_path: local folder {local} not found")
    return name


def _from_pretrained(factory: Any, ref: str, cfg: ModelConfig, **kwargs: Any) -> Any:
    # a load from a GGUF file names that file when it fails
    key, what = (("model.gguf_file", kwargs["gguf_file"]) if kwargs.get("gguf_file")
                 else ("model.name_or_path", ref))
    try:
        return factory.from_pretrained(
            ref, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as exc:
        if Path(ref).exists():
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PipelineError(f"{key} {what}: cannot load ({first})") from None
        if isinstance(exc, ValueError):
            raise PipelineError(f"{key} {what}: {str(exc).splitlines()[0]}") from None
        raise hub_unreachable("model.name_or_path", ref, exc,
                              "point model.name_or_path at a local folder",
                              retry_online=False) from exc


def load_tokenizer(cfg: ModelConfig, root: Path):
    """The model's tokenizer (or `tokenizer_name_or_path`), with the configured added and
    special tokens, and a pad token: see `choose_pad_token`."""
    from transformers import AutoTokenizer

    if cfg.tokenizer_name_or_path:
        tok = _from_pretrained(AutoTokenizer, resolve_model_ref(cfg.tokenizer_name_or_path, root),
                               cfg)
    else:  # the model's: from its GGUF file when it has one
        ref = resolve_model_ref(cfg.name_or_path, root)
        tok = _from_pretrained(AutoTokenizer, ref, cfg, **_gguf(cfg, ref))
    if cfg.special_tokens:
        tok.add_special_tokens(dict(cfg.special_tokens))
    if cfg.added_tokens:
        tok.add_tokens(list(cfg.added_tokens))
    if tok.pad_token_id is None:
        tok.pad_token = choose_pad_token(tok)
    return tok


def choose_pad_token(tok) -> str:
    """A tokenizer without a pad token pads with its unknown token when it has one apart from
    EOS and BOS (Llama's <unk>), else with EOS (GPT-2 has nothing else; adding a token would
    grow the vocabulary). Either is safe here: padding is masked out of attention and labels
    by position, never by comparing ids with the pad id, so an EOS pad is never taken out of
    training (the anchors' "never stops" bug) and the unknown token is never a target."""
    special = {tok.eos_token_id, tok.bos_token_id}
    if tok.unk_token is not None and tok.unk_token_id not in special:
        return tok.unk_token
    return tok.eos_token


def _gguf(cfg: ModelConfig, ref: str) -> dict[str, Any]:
    """`gguf_file` for a load of the base (model.gguf_file), else nothing."""
    argument = gguf_argument(cfg, ref)
    return {"gguf_file": argument} if argument else {}


def load_model_config(cfg: ModelConfig, root: Path):
    from transformers import AutoConfig

    ref = resolve_model_ref(cfg.name_or_path, root)
    return _from_pretrained(AutoConfig, ref, cfg, **_gguf(cfg, ref))


def max_positions(cfg: ModelConfig, root: Path) -> int | None:
    mc = load_model_config(cfg, root)
    return getattr(mc, "max_position_embeddings", None) or getattr(mc, "n_positions", None)


def check_quantization(cfg: ModelConfig) -> None:
    """Fail fast (before torchrun starts) when quantised loading cannot work here."""
    _quantization(cfg, build=False)


def _quantization(cfg: ModelConfig, build: bool = True) -> dict[str, Any]:
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        return {}
    key = "model.load_in_4bit" if cfg.load_in_4bit else "model.load_in_8bit"
    # its CUDA GPU: a machine row of finetune/config/compat.py, checked before any load
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise PipelineError(f"{key}: needs bitsandbytes; pip install bitsandbytes") from None
    if not build:
        return {}
    from transformers import BitsAndBytesConfig

    compute = DTYPES.get(cfg.dtype, torch.bfloat16)
    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=cfg.load_in_4bit,
            load_in_8bit=cfg.load_in_8bit,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_use_double_quant=True,
        )
    }


# model.auto_class_name -> a class with `from_pretrained`. transformers' AutoModelFor* names
# resolve by themselves; register others (a custom architecture, a subclass with a patched
# forward) with `register_model_class`, or name them as "module:Class".
MODEL_CLASSES: dict[str, Any] = {}


def register_model_class(key: str, cls: Any = None):
    """`register_model_class("my-llama", MyLlama)`, or as a class decorator."""
    def add(klass):
        if not hasattr(klass, "from_pretrained"):
            raise TypeError(f"{klass!r} has no from_pretrained")
        MODEL_CLASSES[key] = klass
        return klass

    return add(cls) if cls is not None else add


def model_class(name: str):
    """Resolve model.auto_class_name (registry key, transformers Auto class, module:Class)."""
    import transformers

    from finetune.imports import load_object

    if name in MODEL_CLASSES:
        return MODEL_CLASSES[name]
    if ":" in name:
        klass = load_object(name, "model.auto_class_name")
        return MODEL_CLASSES.get(name) or register_model_class(name, klass)
    if name.startswith("AutoModel") and hasattr(transformers, name):
        return getattr(transformers, name)
    known = ", ".join(sorted(MODEL_CLASSES)) or "none"
    raise PipelineError(
        f"model.auto_class_name '{name}': not a transformers AutoModel class, a registered key "
        f"(registered: {known}) or a 'module:Class' path"
    )


def refuse_encoder_decoder(model_config, source: str) -> None:
    """An encoder-decoder model (T5-style) reached by a path the config rows cannot see (a
    folder's config.json, model.model_init, a 'module:Class'): refused before anything trains
    on the wrong label layout (finetune.datatypes.base.ENCODER_DECODER_WHY)."""
    from finetune.datatypes.base import ENCODER_DECODER_WHY

    if getattr(model_config, "is_encoder_decoder", False):
        kind = getattr(model_config, "model_type", None) or type(model_config).__name__
        raise PipelineError(f"{source}: a {kind} model: {ENCODER_DECODER_WHY}")


def load_base_model(cfg: ModelConfig, root: Path, ref: str | None = None,
                    labels: list[str] | None = None, construct: str = "default",
                    device: torch.device | None = None,
                    log: Callable[[str], None] | None = None):
    """The base model as configured (class, dtype, attention kernel, quantisation, GGUF
    file); `ref`: a trained full model's folder to load instead of the base. `labels`:
    a classifier's class names (the head gets one output per class). `construct`
    (training.construct_model_on): default loads on the CPU; device loads straight onto
    `device`; meta builds a skeleton whose weights `engine.modeling.construction.materialise` reads
    later, once the strategy has kept this rank's part. `log`: where a GGUF base's
    dequantization line goes (default: stdout)."""
    factory = model_class(cfg.auto_class_name)
    grows = bool(cfg.added_tokens or cfg.special_tokens)
    # the tokenizer, only when the model depends on it: loaded once for both uses
    tok = load_tokenizer(cfg, root) if labels or grows else None
    kwargs: dict[str, Any] = {"attn_implementation": cfg.attn_implementation}
    if labels:
        kwargs.update(classifier_kwargs(labels, tok.pad_token_id))
    if cfg.dtype != "auto":
        kwargs["dtype"] = DTYPES[cfg.dtype]
    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    kwargs.update(_quantization(cfg))
    if construct == "device":
        kwargs["device_map"] = {"": str(device)}
    if construct == "meta":  # the config's rules leave no quantisation, heads or new tokens
        from engine.modeling.construction import skeleton

        config = load_model_config(cfg, root)
        kwargs.setdefault("dtype", getattr(config, "dtype", None) or torch.float32)  # "auto"
        model = skeleton(factory, config, **kwargs)
    elif cfg.model_init and ref is None:
        model = _from_model_init(cfg, kwargs, device if construct == "device" else None)
    elif ref is None and cfg.gguf_file:
        base = resolve_model_ref(cfg.name_or_path, root)
        gguf = _gguf(cfg, base)
        model = _from_pretrained(factory, base, cfg,
                                 **{**kwargs, **gguf, **dense_load_kwargs()})
        model = as_dense_model(model, cfg, base, gguf["gguf_file"],
                               log or (lambda line: print(line, flush=True)))
    else:
        model = _from_pretrained(factory, ref or resolve_model_ref(cfg.name_or_path, root), cfg,
                                 **kwargs)
    if cfg.auto_class_name != SEQ_2_SEQ_LM.auto_class:  # the seq2seq type's model class
        refuse_encoder_decoder(model.config, "model.model_init" if cfg.model_init and ref is None
                               else f"model.name_or_path {ref or cfg.name_or_path}")
    model.config.use_cache = cfg.use_cache
    if grows:
        grow_vocabulary(model, len(tok))
    if kwargs.get("quantization_config") is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model)
    return model


def _from_model_init(cfg: ModelConfig, kwargs: dict[str, Any], device=None):
    """model.model_init: the user's factory instead of from_pretrained (dtype applied here);
    `device`: the factory runs with it as the default device (construct_model_on: device)."""
    from transformers import PreTrainedModel

    from finetune.imports import load_object

    kwargs.pop("device_map", None)
    if kwargs.get("quantization_config") is not None or "num_labels" in kwargs:
        raise PipelineError("model.model_init builds the model itself: quantised loading and "
                            "classification heads are from_pretrained options; remove one")
    factory = load_object(cfg.model_init, "model.model_init")
    if device is not None:
        with torch.device(device):
            model = factory()
    else:
        model = factory()
    if not isinstance(model, PreTrainedModel):
        raise PipelineError(f"model.model_init: '{cfg.model_init}' returned "
                            f"{type(model).__name__}, not a transformers PreTrainedModel")
    if "dtype" in kwargs:
        model = model.to(kwargs["dtype"])
    return model


def load_trained(cfg: ModelConfig, peft_cfg: PeftSection, root: Path, trained_dir: Path,
                 base=None):
    """The fine-tuned model from the train stage's output (adapter on base, or full weights).

    `base`, if given, is the already-loaded base model; the adapter is injected into it. A
    classifier's class names come from the trained folder's labels.json."""
    labels = read_labels(trained_dir)
    if peft_cfg.use_peft:
        from peft import PeftModel

        base = base if base is not None else load_base_model(cfg, root, labels=labels)
        with peft_wrapping():
            return PeftModel.from_pretrained(base, str(trained_dir))
    return load_base_model(cfg, root, ref=str(trained_dir), labels=labels)


def base_model(model):
    """The transformers model inside a PEFT wrapper (the model itself when not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


@contextlib.contextmanager
def peft_wrapping():
    """Around PEFT's wrapping of a model: peft 0.21's PeftModel.__init__ asks the model
    `is_gradient_checkpointing`, a property transformers 5 deprecated for
    `is_activation_checkpointing` (same answer), so every wrap printed a FutureWarning that no
    code of ours can act on. Only that warning, raised inside this block, is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
