"""A GGUF file as the base model (model.gguf_file): it trains and evaluates as the safetensors
model it was written from, its tokenizer tokenizes the same, a quantized file is dequantized
on load (one log line) into a dense model, and what cannot work with it is one line, exit 2.

The GGUF files are written here, by the project's own GGUF writer
(tasks.exporters.gguf.model_file), from the shipped stories260K and a small random Llama.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import ROOT, adapter, copy_project, losses, stages_here, train_in_place, write_params
from flows.cli import main

STORIES = ROOT / "data/models/stories260K"
GGUF_DIR = "data/models/stories260K-gguf"  # in a test project: the GGUF alone, no config.json
GGUF_NAME = "stories260K-f32.gguf"
#: 2 steps logged each, evaluated at the end (the default params otherwise)
TWO_STEPS = {"training.max_steps": 2, "logging.logging_steps": 1, "checkpoint.save_steps": 2,
             "eval.eval_steps": 2}


def write_gguf(model_dir: Path, path: Path, file_type: str) -> Path:
    """The model in `model_dir` (safetensors) as a GGUF file of `file_type`, by our writer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.exporters.gguf.model_file import write_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_model(model, AutoTokenizer.from_pretrained(model_dir), path, file_type)
    return path


@pytest.fixture(scope="module")
def two_bases(tokenized, tmp_path_factory):
    """The same 2-step run, from stories260K's safetensors and from its f32 GGUF (data stages
    run again with the GGUF's tokenizer), each then evaluated and exported: (safetensors,
    gguf, gguf's train log)."""
    top = tmp_path_factory.mktemp("gguf-base")
    plain, from_gguf = top / "safetensors", top / "gguf"
    for project in (plain, from_gguf):
        shutil.copytree(tokenized, project, symlinks=True)
        write_params(project, TWO_STEPS)
    write_gguf(STORIES, from_gguf / GGUF_DIR / GGUF_NAME, "f32")
    write_params(from_gguf, {"model.name_or_path": GGUF_DIR, "model.gguf_file": GGUF_NAME})
    stages_here(from_gguf, "format", "tokenize")
    train_in_place(plain)
    log = train_in_place(from_gguf).stdout
    stages_here(plain, "evaluate", "export")
    stages_here(from_gguf, "evaluate", "export")
    return plain, from_gguf, log


def _tokenized_ids(project: Path, split: str) -> list[list[int]]:
    import datasets

    return datasets.load_from_disk(str(project / "data/tokenized" / split))["input_ids"]


def test_gguf_tokenizer_tokenizes_as_the_model_folder_does(two_bases):
    plain, from_gguf, _ = two_bases
    for split in ("train", "test"):
        ids = _tokenized_ids(from_gguf, split)
        assert ids and ids == _tokenized_ids(plain, split), split


def test_f32_gguf_base_trains_and_evaluates_as_the_safetensors_base(two_bases):
    """Same weights, same tokens: the base's held-out loss (what step 0 starts from), every
    logged training loss and the trained adapter are bitwise those of the safetensors run."""
    plain, from_gguf, log = two_bases
    metrics = [json.loads((p / "data/metrics/eval.json").read_text()) for p in two_bases[:2]]
    assert metrics[1]["base"]["loss"] == metrics[0]["base"]["loss"]
    assert metrics[1]["finetuned"]["loss"] == metrics[0]["finetuned"]["loss"]
    assert metrics[1]["finetuned"]["loss"] < metrics[1]["base"]["loss"]  # it trained
    assert len(losses(from_gguf)) == 2 and losses(from_gguf) == losses(plain)
    a, b = adapter(plain), adapter(from_gguf)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "[model]" not in log  # plain floats: nothing dequantized, nothing said


def test_export_merges_the_adapter_into_the_gguf_base(two_bases):
    """The export stage loads the base again (from the GGUF file) and merges the adapter: the
    merged model is the safetensors run's, and its card names the file."""
    from safetensors.torch import load_file

    plain, from_gguf, _ = two_bases
    a, b = (load_file(str(p / "data/export/model.safetensors")) for p in (plain, from_gguf))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = (from_gguf / "data/export/README.md").read_text()
    assert f"- Base model: `{GGUF_DIR}` (`{GGUF_DIR}, GGUF file {GGUF_NAME}`)" in card


@pytest.fixture(scope="module")
def q8_base(tmp_path_factory) -> tuple[Path, Path]:
    """A small random Llama whose rows divide into Q8_0's blocks of 32 (stories260K's FFN of
    172 does not): its safetensors folder, and its Q8_0 GGUF alone in another folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    top = tmp_path_factory.mktemp("q8")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512))
    model.save_pretrained(top / "dense")
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(top / "dense")
    return top / "dense", write_gguf(top / "dense", top / "gguf/tiny-q8_0.gguf", "q8_0")


def test_quantized_gguf_is_dequantized_on_load_into_a_dense_model(q8_base, tmp_path):
    from engine.modeling.gguf_base import quantized_types
    from engine.modeling.model import load_base_model, load_tokenizer
    from finetune.config.model import ModelConfig

    dense, gguf = q8_base
    assert quantized_types(str(gguf)) == ["Q8_0"]
    cfg = ModelConfig(name_or_path=str(gguf.parent), gguf_file=gguf.name)
    said: list[str] = []
    model = load_base_model(cfg, ROOT, log=said.append)
    assert said == ["[model] tiny-q8_0.gguf holds Q8_0 tensors: dequantized to float32 on "
                    "load (transformers' GGUF loader)"]
    # dense: no quantizer left on it (transformers' would make it unsavable and untrainable)
    assert not getattr(model, "is_quantized", False) and not hasattr(model, "hf_quantizer")
    assert getattr(model.config, "quantization_config", None) is None
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("proj"))
    model.save_pretrained(tmp_path / "saved")
    # Q8_0: each block of 32 in steps of 1/127 of its largest value, the step stored as a
    # float16 (rounding it moves the top codes by up to 127 * 2**-11 steps): within 0.6 step
    original = load_base_model(ModelConfig(name_or_path=str(dense)), ROOT).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == original.keys()
    for name, weight in original.items():
        if weight.dim() == 2:
            blocks = weight.reshape(-1, 32)
            bound = blocks.abs().amax(1, keepdim=True) / 127 * 0.6 + 1e-7
            assert ((loaded[name].reshape(-1, 32) - blocks).abs() <= bound).all(), name
        else:
            assert torch.equal(loaded[name], weight), name
    # and the tokenizer is the file's: the same ids as the folder's own
    text = "Once upon a time, there was a little girl."
    assert (load_tokenizer(cfg, ROOT)(text).input_ids
            == load_tokenizer(ModelConfig(name_or_path=str(dense)), ROOT)(text).input_ids)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("refusals") / "p")


def validate(project, capsys, monkeypatch, *overrides: str) -> tuple[int, str]:
    """`finetune validate -s ...` in this process; (exit code, its one error line or '')."""
    monkeypatch.chdir(project)
    code = main(["validate", *[a for o in overrides for a in ("-s", o)]])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == (code != 0), err
    return code, errors[0] if errors else ""


def test_missing_gguf_file_is_one_line_naming_key_and_path(project, capsys, monkeypatch):
    code, line = validate(project, capsys, monkeypatch, "+model.gguf_file=nope.gguf")
    assert code == 2
    assert line == (f"error: model.gguf_file: {project / 'data/models/stories260K/nope.gguf'} "
                    "not found (a GGUF file in model.name_or_path data/models/stories260K)")


@pytest.mark.parametrize("other, says", [
    ("+model.load_in_4bit=true", "does not combine with load_in_4bit or load_in_8bit "
     "(transformers loads a GGUF file through its own GGUF quantizer and refuses a "
     "bitsandbytes quantization on the same load; set them false"),
    ("+model.load_in_8bit=true", "does not combine with load_in_4bit or load_in_8bit"),
    ("+model.model_init=m:f", "does not combine with model_init (model_init builds the model "
     "itself, so the GGUF file would give only the tokenizer"),
    ("+training.construct_model_on=meta", "does not combine with training.construct_model_on "
     "meta (the skeleton's weights are read from safetensors shards"),
])
def test_what_cannot_load_from_a_gguf_file_is_refused(project, capsys, monkeypatch, other,
                                                       says):
    code, line = validate(project, capsys, monkeypatch, "+model.gguf_file=base.gguf", other)
    assert code == 2
    assert line.startswith("error: params/default.yaml: "), line
    assert "gguf_file: base.gguf " + says in line, line
