"""`gguf`: llama.cpp's files in `<export>/gguf` (docs/gguf.md), written when export.gguf lists
types:

- `<name>-<type>.gguf`, the merged model (`ctx.servable`) in each listed type (model_file.py);
- `<name>-lora-<f16|f32>.gguf`, the adapter alone, for LoRA runs with export.save_adapter
  (lora.py), which llama.cpp applies to a GGUF of the base model with `--lora`;
- `Modelfile`, for `ollama create` (modelfile.py), built from the first listed type: list the
  one to serve first;
- `manifest.json`: each file's type, size and sha256, which the model card, the training's
  MLflow run and the registered version show (`entries`, `tags`).

`<name>` is the registered model's name (registry.registered_model_name, else
logging.experiment_name). Everything that can be refused (a type name, the architecture, a
type's block size against each tensor, an adapter llama.cpp cannot apply) is checked by `check`
before any format writes a file.
"""

from __future__ import annotations

import re
from pathlib import Path

from finetune.config import FinetuneConfig
from finetune.config.section import did_you_mean
from finetune.errors import PipelineError
from finetune.files import file_sha256, write_json_atomic
from tasks.exporters.base import Exporter
from tasks.exporters.context import ExportContext
from tasks.exporters.gguf import quants

GGUF_DIR = "gguf"
MANIFEST = "manifest.json"
MODELFILE = "Modelfile"


def check_types(types) -> None:
    """One line for a name quants.FILE_TYPES does not have (`finetune validate` asks too)."""
    for name in types:
        if name not in quants.FILE_TYPES:
            raise PipelineError(f"export.gguf: unknown type '{name}'"
                                f"{did_you_mean(name, quants.FILE_TYPES)}: one of "
                                f"{', '.join(quants.FILE_TYPES)}")


def model_name(cfg: FinetuneConfig) -> str:
    """The files' stem: the registered model's name, as a file name."""
    name = cfg.registry.registered_model_name or cfg.logging.experiment_name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def trained_chat(cfg: FinetuneConfig) -> bool:
    """The run trained on conversations rendered by a chat template (its prompts are chats)."""
    return cfg.data.dataset_type == "chat" or bool(cfg.data.chat_template)


def runner(cfg: FinetuneConfig) -> str:
    """llama.cpp's command for the run's prompts: llama-cli holds a chat (the chat template
    applied), llama-completion continues a raw prompt (a completion run's layout)."""
    return "llama-cli" if trained_chat(cfg) else "llama-completion"


def writes_lora(cfg: FinetuneConfig) -> bool:
    """The adapter alone is written as a LoRA-GGUF: a LoRA run that keeps its adapter."""
    return cfg.peft.use_peft and cfg.peft.peft_type == "LORA" and cfg.export.save_adapter


def check(ctx: ExportContext):
    """Everything `write` would refuse, before anything is written; returns the family and the
    LoRA plan (None without one) `write` uses."""
    from tasks.exporters.gguf.lora import plan

    cfg = ctx.config
    check_types(cfg.export.gguf)
    family = check_shapes(ctx.model.config, *_plain_shapes(ctx), cfg.export.gguf)
    lora = plan(ctx.ws.layout.trained, family) if writes_lora(cfg) else None
    return family, lora


def check_shapes(config, shapes: dict[str, tuple[int, ...]], tied: bool, types):
    """The model's architecture (its Family, returned) and every tensor's row against the
    block size of the type each listed file type gives it (as model_file plans it: a tied
    output head is token_embd's); one line for the first that does not fit."""
    from tasks.exporters.gguf.families import family_for
    from tasks.exporters.gguf.model_file import plan_tensors

    family = family_for(config)
    for file_type in types:
        plan_tensors(family, shapes, tied, file_type, config.num_hidden_layers)
    return family


def check_before_training(ws) -> None:
    """What `finetune validate` can tell from the params and the base model's config alone:
    the type names, and the architecture and block sizes on a weightless skeleton (meta
    device), so a type the model cannot be encoded in is refused before a run trains, not
    after. The adapter is the export stage's to check (it exists only after training)."""
    cfg = ws.config
    check_types(cfg.export.gguf)
    if not cfg.export.gguf or cfg.model.model_init:  # a factory's model: known when built
        return
    auto = cfg.model_task.auto_class
    if auto != "AutoModelForCausalLM":
        raise PipelineError(f"export.gguf: the model is an {auto} ({cfg.data.dataset_type} "
                            "data); llama.cpp runs causal language models only")
    import torch
    from transformers import AutoModelForCausalLM

    from engine.export import load_model_config

    config = load_model_config(cfg.model, ws.root)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    check_shapes(config, {n: tuple(t.shape) for n, t in skeleton.state_dict().items()},
                 _tied(config), cfg.export.gguf)


def preflight(ctx: ExportContext) -> None:
    """`check`, when export.gguf lists types: the export stage asks before any format
    writes."""
    if ctx.config.export.gguf:
        check(ctx)


def _plain_shapes(ctx: ExportContext) -> tuple[dict[str, tuple[int, ...]], bool]:
    """The merged model's tensor shapes and whether its output head is its embedding, without
    merging an unmerged run's adapter (that would unload it from the model the HF folder
    saves): then its architecture on the meta device, tied as its config says."""
    import torch

    if ctx.merged or not ctx.config.peft.use_peft:
        # the HF folder's model: merging it now changes nothing
        from tasks.exporters.gguf.model_file import tied_head

        state = ctx.servable.state_dict()
        tied = tied_head(state)  # as the writer finds it
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            state = AutoModelForCausalLM.from_config(ctx.model.config).state_dict()
        tied = _tied(ctx.model.config)
    return {name: tuple(t.shape) for name, t in state.items()}, tied


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def write(ctx: ExportContext) -> Path | None:
    from tasks.exporters.gguf.lora import lora_type, write_lora
    from tasks.exporters.gguf.model_file import write_model
    from tasks.exporters.gguf.modelfile import Sampling, modelfile

    cfg = ctx.config
    if not cfg.export.gguf:
        return None
    family, lora = check(ctx)
    folder = ctx.staging / GGUF_DIR
    folder.mkdir()
    name, model, tok = model_name(cfg), ctx.servable, ctx.tokenizer
    chat_template = getattr(tok, "chat_template", None)
    generation_config = getattr(model, "generation_config", None)
    written = []
    for file_type in cfg.export.gguf:
        path = folder / f"{name}-{file_type}.gguf"
        write_model(model, tok, path, file_type, chat_template=chat_template,
                    generation_config=generation_config, name=name)
        written.append(("model", file_type, path))
    if lora is not None:
        tensor_type = lora_type(cfg.export.gguf)
        path = folder / f"{name}-lora-{tensor_type}.gguf"
        write_lora(lora, family, model.config, path, tensor_type, name=f"{name}-lora")
        written.append(("lora", tensor_type, path))
    positions = getattr(model.config, "max_position_embeddings", None)
    sampling = Sampling.of(generation_config, cfg.eval.generation_max_new_tokens,
                           min(cfg.data.max_seq_length, positions or cfg.data.max_seq_length))
    (folder / MODELFILE).write_text(modelfile(
        written[0][2].name, tokenizer=tok,
        chat_template=chat_template if trained_chat(cfg) else None,
        prompt_template=cfg.data.prompt_template, sampling=sampling))
    write_json_atomic(folder / MANIFEST, [
        {"file": path.name, "kind": kind, "type": file_type, "size": path.stat().st_size,
         "sha256": file_sha256(path)} for kind, file_type, path in written])
    return folder


def entries(export_dir: Path) -> list[dict]:
    """The manifest of the GGUF files under `export_dir` (the export folder, or the one being
    built); [] when none were written."""
    import json

    manifest = export_dir / GGUF_DIR / MANIFEST
    return json.loads(manifest.read_text()) if manifest.exists() else []


def tags(written: list[dict]) -> dict[str, str]:
    """The manifest as MLflow tags: `gguf.<type>.sha256` per merged file,
    `gguf.lora.<type>.sha256` for the adapter, and the types written (`gguf.types`)."""
    if not written:
        return {}
    out = {"gguf.types": ",".join(e["type"] for e in written if e["kind"] == "model")}
    for e in written:
        prefix = "gguf." if e["kind"] == "model" else "gguf.lora."
        out[f"{prefix}{e['type']}.sha256"] = e["sha256"]
    return out


def card_section(ctx: ExportContext, export_dir: Path) -> str:
    """The GGUF files with their sha256, and how to run them; '' when none were written."""
    written = entries(ctx.staging)
    if not written:
        return ""
    folder = f"{export_dir.as_posix()}/{GGUF_DIR}"
    rows = "\n".join(f"| `{e['file']}` | {'LoRA adapter, ' if e['kind'] == 'lora' else ''}"
                     f"{e['type']} | {e['size']} | `{e['sha256']}` |" for e in written)
    model = next(e["file"] for e in written if e["kind"] == "model")
    lora = next((e["file"] for e in written if e["kind"] == "lora"), None)
    name, run = model_name(ctx.config), runner(ctx.config)
    with_lora = "" if lora is None else f"""
The adapter alone applies to a GGUF of the base model (`BASE.gguf`, yours):
```bash
{run} -m BASE.gguf --lora {folder}/{lora} -p "..." -n 32
```
"""
    return f"""
## GGUF (llama.cpp, Ollama)
Files for llama.cpp and Ollama in `{GGUF_DIR}/` (the merged model in each type, listed in
`{GGUF_DIR}/{MANIFEST}`; docs/gguf.md of the project that wrote them):

| file | type | bytes | sha256 |
|---|---|---|---|
{rows}

```bash
{run} -m {folder}/{model} -p "..." -n 32
ollama create {name} -f {folder}/{MODELFILE} && ollama run {name}
```
{with_lora}"""


class GGUFExporter(Exporter):
    name = "gguf"

    def check(self, ws) -> None:
        check_before_training(ws)

    def preflight(self, ctx: ExportContext) -> None:
        preflight(ctx)

    def write(self, ctx: ExportContext) -> Path | None:
        return write(ctx)

    def card_section(self, ctx: ExportContext, export_dir: Path) -> str:
        return card_section(ctx, export_dir)

    def tags(self, export_dir: Path) -> dict[str, str]:
        return tags(entries(export_dir))
