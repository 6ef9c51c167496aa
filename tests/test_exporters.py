"""The export stage writes the formats export.formats lists, each a module of tasks/exporters
named in one registry: the list chooses what is written, an unknown name is one line before any
work, and a new format is one registry line. The export stage's function runs in this process
(no process boundary is under test here); the CLI's one line is in tests/test_validate.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import BASE, stages_here, train_here, write_params

from finetune.errors import PipelineError

#: the HF folder at the export root, as the default params write it (adapter merged)
HF_FILES = ["README.md", "config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def trained(tokenized, tmp_path_factory) -> Path:
    """The default LoRA run, shrunk and trained once (no MLflow run: nothing is registered)."""
    project, _ = train_here(tokenized, tmp_path_factory.mktemp("exporters") / "p", BASE)
    return project


def export_copy(trained: Path, dest: Path, overrides: dict | None = None) -> Path:
    shutil.copytree(trained, dest, symlinks=True)
    if overrides:
        write_params(dest, overrides)
    stages_here(dest, "export")
    return dest / "data/export"


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_the_list_chooses_the_formats_and_the_default_writes_them_all(trained, tmp_path):
    everything = export_copy(trained, tmp_path / "default")
    trained_files = files(trained / "data/trained")
    assert files(everything) == sorted(HF_FILES + [f"adapter/{f}" for f in trained_files])
    card = (everything / "README.md").read_text()
    assert "The adapter alone (for users who keep the base model) is in `adapter/`" in card
    assert "formats" not in card  # the default list: the card's params are as they were

    # save_adapter is still true: the list alone leaves the adapter out
    hf_only = export_copy(trained, tmp_path / "hf", {"export.formats": ["hf"]})
    assert files(hf_only) == HF_FILES
    card = (hf_only / "README.md").read_text()
    assert "The adapter alone" not in card and "  formats:\n  - hf\n" in card
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (hf_only / name).read_bytes() == (everything / name).read_bytes(), name


def test_an_unknown_format_is_one_line_before_any_work(trained, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(trained, project, symlinks=True)
    write_params(project, {"export.formats": ["hf", "adaptor"]})
    with pytest.raises(PipelineError) as exc:
        stages_here(project, "export")
    assert str(exc.value) == ("export.formats: unknown format 'adaptor' (did you mean "
                              "'adapter'?): one of hf, adapter, quantized, gguf")
    assert not (project / "data/export").exists()


def test_a_new_format_is_one_registry_line(trained, tmp_path, monkeypatch):
    """A toy exporter: one class and one line in the registry, and export.formats can list
    it. It runs after hf whatever the list's order (it reads the config.json hf wrote), with
    the context's models and run; its file ships in the export folder, its card section is in
    the model card and its tags are the run's."""
    from tasks.exporters import EXPORTERS, Exporter, ExportContext, resolve

    class Toy(Exporter):
        name = "toy"

        def write(self, ctx: ExportContext) -> Path:
            model_type = json.loads((ctx.staging / "config.json").read_text())["model_type"]
            out = ctx.staging / "toy.txt"
            out.write_text(f"{model_type} {type(ctx.hf_model).__name__} {ctx.formats}\n")
            return out

        def card_section(self, ctx, export_dir) -> str:
            return f"\n## Toy\nIn `{export_dir}/toy.txt`.\n"

        def tags(self, export_dir) -> dict[str, str]:
            return {"toy.bytes": str((export_dir / "toy.txt").stat().st_size)}

    with pytest.raises(PipelineError, match="unknown format 'toy'"):
        resolve(["toy", "hf"])
    monkeypatch.setitem(EXPORTERS, "toy", Toy())
    export = export_copy(trained, tmp_path / "toy", {"export.formats": ["toy", "hf"]})
    assert (export / "toy.txt").read_text() == "llama LlamaForCausalLM ('toy', 'hf')\n"
    assert "\n## Toy\nIn `data/export/toy.txt`.\n" in (export / "README.md").read_text()
    assert files(export) == sorted(HF_FILES + ["toy.txt"])
    from tasks.exporters import tags

    assert tags(["toy", "hf"], export) == {"toy.bytes": "37"}


def test_the_default_format_list_is_the_registrys():
    """export.formats' default (finetune.config.export.EXPORT_FORMATS: the config cannot
    import the stages) names every registered exporter, in the order they are written, and
    each exporter's name is its registry key."""
    from finetune.config.export import EXPORT_FORMATS
    from tasks.exporters import EXPORTERS

    assert EXPORT_FORMATS == tuple(EXPORTERS)
    assert all(exporter.name == name for name, exporter in EXPORTERS.items())
