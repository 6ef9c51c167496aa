"""The `export` section: what the export stage writes (the HF folder, the adapter alone, the
quantized model, GGUF files). The formats themselves are tasks/exporters' (a test ties
EXPORT_FORMATS to that registry).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from finetune.config.section import Section

#: export.formats unless set: every format, each written when it applies (tasks/exporters)
EXPORT_FORMATS = ("hf", "adapter", "quantized", "gguf")


class ExportConfig(Section):
    """What the export stage writes."""

    merge_adapter: bool = Field(True, description="Fold the adapter into the base weights.")
    save_adapter: bool = Field(
        True, description="Also write the adapter alone to <export>/adapter (PEFT runs)."
    )
    max_shard_size: str = Field("2GB", description="safetensors shard size.")
    formats: list[str] = Field(
        default_factory=lambda: list(EXPORT_FORMATS),
        description="What the export stage writes (tasks/exporters), each when it applies to "
        "the run: hf, the self-contained HF folder at the export root (always listed: the model "
        "card is in it, the other formats' folders too, and the registry logs its model); "
        "adapter, the PEFT adapter alone in <export>/adapter (PEFT runs with merge_adapter and "
        "save_adapter); quantized, the QAT model converted, in <export>/quantized (runs with "
        "training.qat_recipe); gguf, llama.cpp's files in <export>/gguf (when export.gguf "
        "lists types). Written hf first, whatever the list's order.")
    gguf: list[str] = Field(
        default_factory=list,
        description="GGUF file types the export stage writes to <export>/gguf (f32, f16, "
        "bf16, q8_0, q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s: tasks/exporters/gguf/quants.py), "
        "the adapter merged, one file each, "
        "with an Ollama Modelfile and, for LoRA runs with save_adapter, the adapter alone as "
        "a LoRA-GGUF (docs/gguf.md). Empty: none.")

    @field_validator("formats")
    @classmethod
    def _hf_once(cls, formats: list[str]) -> list[str]:
        if "hf" not in formats:
            raise ValueError("list hf: the HF folder holds the model card and the other "
                             "formats' folders, and the registry logs its model")
        twice = [f for i, f in enumerate(formats) if f in formats[:i]]
        if twice:
            raise ValueError(f"'{twice[0]}' is listed twice")
        return formats

    @field_validator("gguf")
    @classmethod
    def _gguf_once(cls, types: list[str]) -> list[str]:
        """Names are checked against the encoders (tasks/exporters/gguf/quants.py) by
        `finetune validate` and the export stage; a name twice would write one file twice."""
        twice = [t for i, t in enumerate(types) if t in types[:i]]
        if twice:
            raise ValueError(f"'{twice[0]}' is listed twice")
        return types
