"""The adapter (PEFT: LoRA, IA3) around the base model: its config, the check that its target
modules exist, and saved adapter files that are byte-identical for identical trainings."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.modeling.model import peft_wrapping, resolve_model_ref
from engine.modeling.vocabulary import GREW, added_rows, embedding_module_names
from finetune.config.model import ModelConfig, PeftSection
from finetune.errors import PipelineError


def peft_config(cfg: PeftSection, modules_to_save: list[str] | None = None,
                tied: bool = False, tokens: list[int] | dict[str, list[int]] | None = None):
    """`tied`: the model ties its input and output embeddings and one of them is trained in
    full: LoRA keeps them one weight (peft's ensure_weight_tying); IA3 cannot. `tokens`: the
    rows that train on their own (LoRA's trainable_token_indices, resolved)."""
    from peft import IA3Config, LoraConfig

    if cfg.peft_type == "IA3":
        if tied:
            raise PipelineError(
                "peft.peft_type IA3 with added tokens on a model whose input and output "
                "embeddings are tied: peft's IA3 would untie them; use LORA")
        return IA3Config(
            target_modules=cfg.target_modules,
            feedforward_modules=cfg.feedforward_modules or [],
            task_type=cfg.task_type,
            modules_to_save=modules_to_save,
        )
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        bias=cfg.bias,
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
        init_lora_weights=cfg.init_lora_weights,
        layers_to_transform=cfg.layers_to_transform,
        layers_pattern=cfg.layers_pattern,
        rank_pattern=dict(cfg.rank_pattern),
        alpha_pattern=dict(cfg.alpha_pattern),
        target_parameters=cfg.target_parameters,
        task_type=cfg.task_type,
        modules_to_save=modules_to_save,
        ensure_weight_tying=tied,
        trainable_token_indices=tokens,
    )


def apply_peft(model, cfg: PeftSection, seed: int | None = None):
    """Wrap with an adapter (or leave for full fine-tuning). A grown vocabulary's new rows
    must train, since LoRA alone cannot give them a meaning: under LoRA only those rows
    (peft's trainable tokens, `peft.trainable_token_indices: added`), otherwise the
    embedding and output layers in full, saved with the adapter (peft's modules_to_save).
    `seed` (training.seed): pissa_niter_N's randomized SVD draws from it, so a resumed run
    rebuilds the same residual base."""
    if not cfg.use_peft:
        return model
    from peft import get_peft_model

    check_target_modules(model, cfg.target_modules)
    check_target_parameters(model, cfg.target_parameters)
    grew = getattr(model, GREW, None) is not None
    # known once the tokenizer grew the model (the compat table refuses modules_to_save)
    if grew and cfg.mutates_base:
        raise PipelineError(
            f"peft.init_lora_weights: {cfg.init_lora_weights} cannot train a grown "
            "vocabulary (model.added_tokens, special_tokens): peft converts the adapter to one "
            "of the original base from lora_A and lora_B alone, and the embeddings trained in "
            "full would be lost; use init_lora_weights true or gaussian")
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is model.get_input_embeddings().weight
    tokens = trainable_tokens(model, cfg, tied) if cfg.peft_type == "LORA" else None
    extra = embedding_module_names(model) if grew and tokens is None else None
    # a tied embedding trained in full stays one weight; trainable tokens follow a tied head
    # by themselves (peft ties their rows)
    tie = tied and extra is not None
    if cfg.modules_to_save:
        extra = list(dict.fromkeys([*cfg.modules_to_save, *(extra or [])]))
    try:
        with peft_wrapping(), _seeded(seed if cfg.mutates_base else None):
            peft_model = get_peft_model(model, peft_config(cfg, extra, tie, tokens))
    except ValueError as exc:
        raise PipelineError(f"peft.target_modules: {str(exc).splitlines()[0]}") from None
    if cfg.mutates_base:
        keep_initial_adapter(peft_model)
    return peft_model


def _seeded(seed: int | None):
    """The RNG seeded for the base-rewriting initialisations (and restored after, so the
    rest of the run draws as it would), or nothing: the default LoRA init draws from the
    run's RNG as it always did."""
    import contextlib

    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


def check_target_parameters(model, names: list[str] | None) -> None:
    """Each name of peft.target_parameters is a parameter of the model (its whole name or
    its last parts, as peft matches it); peft adapts what matches and ignores the rest."""
    if not names:
        return
    params = [n for n, _ in model.named_parameters()]
    for name in names:
        if not any(p == name or p.endswith(f".{name}") for p in params):
            raise PipelineError(
                f"peft.target_parameters: '{name}' is not a parameter of "
                f"{type(model).__name__}")


#: the adapter as PiSSA / OLoRA made it, before any step (on the PeftModel): what saving
#: subtracts so the saved adapter applies to the original base
INITIAL_ADAPTER = "_finetune_initial_adapter"
#: the name peft loads it under while converting (the folder's name)
INITIAL = "initial"


def keep_initial_adapter(peft_model) -> None:
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    setattr(peft_model, INITIAL_ADAPTER, {k: v.detach().to("cpu", copy=True)
                                          for k, v in state.items()})


def save_adapter(module, folder, state_dict: dict | None = None) -> None:
    """save_pretrained of a PEFT model (or any model: a full fine-tune). An adapter whose
    initialisation rewrote the base (PiSSA, OLoRA) is saved converted by peft
    (`path_initial_model_for_weight_conversion`: rank 2r, [A | A0] and [B | -B0]), so it
    applies to the original base model, which is what every later stage loads."""
    import re
    import tempfile

    from safetensors.torch import save_file

    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    initial = getattr(module, INITIAL_ADAPTER, None)
    if initial is None:
        module.save_pretrained(folder, safe_serialization=True, **kwargs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / INITIAL  # peft writes its config here, the weights are ours
        path.mkdir()
        save_file({k: v.contiguous() for k, v in initial.items()},
                  path / "adapter_model.safetensors")
        if state_dict is not None:  # gathered (FSDP2): peft reads the initial adapter there
            # too, named as the LoRA model (under the PeftModel's `base_model.`) names it
            kwargs["state_dict"] = {**state_dict, **{
                re.sub(r"\.(lora_[AB])\.", rf".\1.{INITIAL}.", k.removeprefix("base_model.")): v
                for k, v in initial.items()}}
        module.save_pretrained(folder, safe_serialization=True,
                               path_initial_model_for_weight_conversion=str(path), **kwargs)


def trainable_tokens(model, cfg: PeftSection, tied: bool) -> list[int] | dict | None:
    """peft.trainable_token_indices as peft takes it, checked against the model: 'added' is
    the grown rows of the input embedding and, unless it is tied to it (peft then ties the
    trained rows too), of the output layer; ids past the vocabulary or a module that is not
    an embedding of the model are refused here, in one line, not deep in peft."""
    wanted = cfg.trainable_token_indices
    if wanted is None:
        return None
    rows = model.get_input_embeddings().weight.shape[0]
    if wanted == "added":
        new = added_rows(model)
        if not new:
            return None
        names = embedding_module_names(model)
        return new if tied or len(names) == 1 else {name: new for name in names}
    full = [name for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))
            and getattr(m, "weight", None) is not None and m.weight.shape[0] == rows]
    layers = {name.rsplit(".", 1)[-1] for name in full}
    for name, ids in (wanted.items() if isinstance(wanted, dict) else [(None, wanted)]):
        key = "peft.trainable_token_indices" + (f".{name}" if name else "")
        if name is not None and not any(f == name or f.endswith(f".{name}") for f in full):
            raise PipelineError(f"{key}: not a layer of the model with one row per token "
                                f"(those are: {', '.join(sorted(layers))})")
        if max(ids) >= rows:
            raise PipelineError(f"{key}: token id {max(ids)} is past the vocabulary "
                                f"({rows} rows)")
    return wanted


def check_target_modules(model, targets) -> None:
    """What peft.target_modules names is in the model, as peft matches it: each name of a
    list is a module's name or its last parts (peft ignores a name that matches nothing as
    long as another one matches: a typo would silently adapt less), a string is a regex that
    must match a module's whole name, 'all-linear' any model with linear layers."""
    import re

    names = [n for n, _ in model.named_modules() if n]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    if targets == "all-linear":
        missing = [] if linear else ["all-linear"]
    elif isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    else:
        missing = [t for t in targets
                   if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise PipelineError(
            f"peft.target_modules: '{missing[0]}' is not a module of the model (its linear "
            f"layers: {', '.join(linear) or 'none'})")


def make_adapter_config_reproducible(model, cfg: ModelConfig) -> None:
    """Byte-identical adapter_config.json for identical trainings, on any machine.

    peft stores "all-linear" targets as a set (written in hash-seed order) and the base model
    as the absolute path it was loaded from (different in every clone); use a sorted list and
    the name_or_path as written in the params file instead.
    """
    for peft_cfg in getattr(model, "peft_config", {}).values():
        if isinstance(peft_cfg.target_modules, (set, frozenset)):
            peft_cfg.target_modules = sorted(peft_cfg.target_modules)
        peft_cfg.base_model_name_or_path = cfg.name_or_path


def make_model_card_reproducible(folder: Path, cfg: ModelConfig, root: Path) -> None:
    """peft's README.md in a saved adapter names the base model by the absolute path it was
    loaded from, so the trained folder (and its DVC hash) differed between two clones of the
    same project; name it as the params file does."""
    card = folder / "README.md"
    loaded_from = resolve_model_ref(cfg.name_or_path, root)
    if card.exists() and loaded_from != cfg.name_or_path:
        card.write_text(card.read_text().replace(loaded_from, cfg.name_or_path))


def peft_model_in(module):
    """The PeftModel a (possibly wrapped) training module holds, or None."""
    from peft import PeftModel

    for candidate in (module, getattr(module, "module", None)):
        if isinstance(candidate, PeftModel):
            return candidate
    return None


def has_adapter(module) -> bool:
    return peft_model_in(module) is not None


def base_rewritten(module) -> bool:
    """PiSSA / OLoRA moved part of the base weights into the adapter: with the adapter
    disabled, the module is the residual, not the base model."""
    peft_model = peft_model_in(module)
    return peft_model is not None and getattr(peft_model, INITIAL_ADAPTER, None) is not None


def adapter_disabled(module):
    """A context in which `module` runs as its base model: the adapter's layers are skipped
    (PEFT's disable_adapter), so a DPO reference needs no second copy of the weights."""
    return peft_model_in(module).disable_adapter()
