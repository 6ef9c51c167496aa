"""The GGUF exporter's own parts (tasks/exporters/gguf): the adapter alone as a LoRA-GGUF that
llama.cpp applies with --lora, the Ollama Modelfile, and the export stage writing them with a
manifest the card, the MLflow run and the registered version show. LoRA and Modelfile run in
this process on stories260K (no process boundary is under test); the export stage runs as
`finetune stage export` does (stages_here) on the shared trained fixture of test_exporters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ROOT

from finetune.errors import PipelineError

BASE_MODEL = ROOT / "data/models/stories260K"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(dest: Path, seed: int = 0, **config) -> tuple[Path, object]:
    """A PEFT LoRA of stories260K saved to `dest`, its B matrices random (PEFT starts them at
    zero, which would make every check below pass on any row order); returns (folder, the
    PEFT model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL)
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8,
                                                     "target_modules": ALL, **config}))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(dest)
    return dest, peft_model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return _lora(tmp_path_factory.mktemp("lora") / "adapter")


def _family():
    from transformers import AutoConfig

    from tasks.exporters.gguf.families import family_for

    config = AutoConfig.from_pretrained(BASE_MODEL)
    return family_for(config), config


def _write(folder: Path, path: Path, tensor_type: str = "f32"):
    from tasks.exporters.gguf.lora import plan, write_lora

    family, config = _family()
    write_lora(plan(folder, family), family, config, path, tensor_type, name="t-lora")
    return path


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {}
    for name, field in reader.fields.items():
        value = field.contents()
        fields[name] = value
    return fields, {t.name: np.array(t.data) for t in reader.tensors}


def test_every_adapted_weight_is_written_in_llamas_shapes_with_alpha(adapter, tmp_path):
    folder, _ = adapter
    fields, tensors = _read(_write(folder, tmp_path / "a.gguf", "f16"))
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama"
    assert fields["adapter.lora.alpha"] == pytest.approx(8.0)
    out = {"attn_q": 64, "attn_k": 32, "attn_v": 32, "attn_output": 64, "ffn_gate": 172,
           "ffn_up": 172, "ffn_down": 64}
    into = {**{k: 64 for k in out}, "ffn_down": 172}
    expected = {}
    for layer in range(5):
        for t in out:
            # numpy order (rows first): lora_a rank x in (ggml ne [in, rank]), lora_b out x rank
            expected[f"blk.{layer}.{t}.weight.lora_a"] = (4, into[t])
            expected[f"blk.{layer}.{t}.weight.lora_b"] = (out[t], 4)
    assert {n: a.shape for n, a in tensors.items()} == expected
    assert {a.dtype for a in tensors.values()} == {np.dtype(np.float16)}
    # the export is a DVC out: the same adapter, the same bytes; nothing left beside it
    again = _write(folder, tmp_path / "b.gguf", "f16")
    assert again.read_bytes() == (tmp_path / "a.gguf").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf"]


def test_q_and_k_rows_of_lora_b_are_permuted_as_the_base_weights(adapter, tmp_path):
    """What llama.cpp computes with --lora, W_gguf + alpha / rank * B_gguf @ A_gguf, is the
    merged model's weight in GGUF order, permute(W + scaling * B @ A), for every adapted
    weight: q/k rows follow the base weight's rope permutation, the rest stay as they are."""
    folder, peft_model = adapter
    family, config = _family()
    fields, tensors = _read(_write(folder, tmp_path / "a.gguf", "f32"))
    alpha = float(fields["adapter.lora.alpha"])
    base = {n: p.detach().clone() for n, p in peft_model.get_base_model().named_parameters()
            if "base_layer" in n}
    merged = peft_model.merge_and_unload().state_dict()
    permuted_any = False
    for name, w in base.items():
        hf_name = name.replace(".base_layer", "")
        gguf_name = family.gguf_name(hf_name)
        a = tensors[f"{gguf_name}.lora_a"]
        b = tensors[f"{gguf_name}.lora_b"]
        w_gguf = family.permute_rows(gguf_name, w.numpy(), config)
        applied = w_gguf + alpha / b.shape[1] * (b @ a)
        expected = family.permute_rows(gguf_name, merged[hf_name].numpy(), config)
        np.testing.assert_allclose(applied, expected, atol=1e-5, err_msg=gguf_name)
        permuted_any |= not np.array_equal(w_gguf, w.numpy())
    assert permuted_any  # the check above saw the permutation at work


def test_rslora_is_written_as_the_alpha_llama_cpp_divides_by_the_rank(tmp_path):
    folder, _ = _lora(tmp_path / "rs", use_rslora=True, target_modules=["q_proj", "v_proj"])
    fields, _ = _read(_write(folder, tmp_path / "rs.gguf"))
    # PEFT's scaling alpha / sqrt(r) = 8 / 2; llama.cpp's alpha / r with r 4: alpha 16
    assert fields["adapter.lora.alpha"] == pytest.approx(16.0)


@pytest.mark.parametrize("config, says", [
    ({"use_dora": True}, "has use_dora true: DoRA rescales each column by a magnitude vector "
     "llama.cpp does not apply; set export.save_adapter false to write the merged GGUF alone"),
    ({"modules_to_save": ["lm_head"]}, "has modules_to_save [\"lm_head\"]: modules trained in "
     "full"),
    ({"trainable_token_indices": [3]}, "has trainable_token_indices [3]: token rows trained "
     "on their own ([3]) are not an adapter llama.cpp applies"),
    ({"target_modules": ["q_proj", "lm_head"]}, "adapts lm_head, which a LoRA-GGUF of llama "
     "cannot hold (its output.weight tensor)"),
    ({"rank_pattern": {"q_proj": 2}, "use_rslora": True}, "is rsLoRA with ranks [2, 4]"),
])
def test_what_llama_cpp_cannot_apply_is_one_line(tmp_path, config, says):
    from tasks.exporters.gguf.lora import plan

    folder, _ = _lora(tmp_path / "x", **config)
    with pytest.raises(PipelineError) as exc:
        plan(folder, _family()[0])
    line = str(exc.value)
    assert "\n" not in line and line.startswith("export.gguf: the adapter in "), line
    assert says in line, line


def test_a_key_that_is_no_lora_matrix_is_refused(adapter, tmp_path):
    """A stray tensor in the weights (a magnitude vector, a module trained in full) even when
    the config does not say so."""
    from safetensors.torch import load_file, save_file

    from tasks.exporters.gguf.lora import plan

    folder = Path(shutil.copytree(adapter[0], tmp_path / "copy"))
    weights = load_file(folder / "adapter_model.safetensors")
    weights["base_model.model.model.norm.weight"] = torch.ones(64)
    save_file(weights, folder / "adapter_model.safetensors")
    with pytest.raises(PipelineError, match="holds base_model.model.model.norm.weight, which is "
                                            "not a LoRA A/B matrix"):
        plan(folder, _family()[0])


# -- the Modelfile --------------------------------------------------------------------------

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: Qwen-style ChatML that adds a default system turn: not plain ChatML
CHATML_DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
                         "Be nice.<|im_end|>\\n' }}{% endif %}" + CHATML)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BASE_MODEL)


def _modelfile(tok, **kwargs) -> str:
    from tasks.exporters.gguf.modelfile import Sampling, modelfile

    args = {"chat_template": None, "prompt_template": None,
            "sampling": Sampling(num_predict=32, num_ctx=256), **kwargs}
    return modelfile("run-f16.gguf", tokenizer=tok, **args)


def test_the_modelfile_of_a_chatml_run(tok):
    text = _modelfile(tok, chat_template=CHATML)
    assert text == _modelfile(tok, chat_template=CHATML)  # same run, same bytes
    assert text.splitlines()[2] == "FROM ./run-f16.gguf"
    assert ("TEMPLATE \"\"\"{{ range .Messages }}{{ if eq .Role \"system\" }}<|im_start|>system\n"
            "{{ .Content }}<|im_end|>\n{{ else if eq .Role \"user\" }}<|im_start|>user\n"
            "{{ .Content }}<|im_end|>\n{{ else if eq .Role \"assistant\" }}"
            "<|im_start|>assistant\n{{ .Content }}<|im_end|>\n{{ end }}{{ end }}"
            "<|im_start|>assistant\n\"\"\"\n") in text
    stops = [ln for ln in text.splitlines() if ln.startswith("PARAMETER stop")]
    assert stops == ['PARAMETER stop "</s>"', 'PARAMETER stop "<|im_end|>"',
                     'PARAMETER stop "<|im_start|>"']
    assert text.endswith("PARAMETER temperature 0\nPARAMETER num_predict 32\n"
                         "PARAMETER num_ctx 256\n")
    # a template that renders otherwise (a default system turn) is not taken for ChatML
    other = _modelfile(tok, chat_template=CHATML_DEFAULT_SYSTEM)
    assert 'TEMPLATE """{{ .Prompt }}"""' in other and "none of the layouts" in other


LLAMA3 = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
          "\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_the_modelfile_of_a_llama3_run(tok):
    text = _modelfile(tok, chat_template=LLAMA3)
    assert "# the run's chat template, in Llama 3's layout" in text
    assert ('{{ else if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n'
            "{{ .Content }}<|eot_id|>") in text
    assert [ln for ln in text.splitlines() if ln.startswith("PARAMETER stop")] == [
        'PARAMETER stop "</s>"', 'PARAMETER stop "<|eot_id|>"',
        'PARAMETER stop "<|start_header_id|>"']


def test_the_modelfile_of_the_default_run_uses_its_prompt_template(tok):
    """The default params: a completion dataset, `Question: {question}\\nAnswer:`."""
    text = _modelfile(tok, prompt_template="Question: {question}\nAnswer:")
    assert text == _modelfile(tok, prompt_template="Question: {question}\nAnswer:")
    assert 'TEMPLATE """Question: {{ .Prompt }}\nAnswer:"""\n' in text
    assert 'PARAMETER stop "</s>"' in text
    # two columns: no single .Prompt, the text as typed, and the comment says why
    plain = _modelfile(tok, prompt_template="{instruction}\n{input}")
    assert 'TEMPLATE """{{ .Prompt }}"""' in plain
    assert "no chat template nor a one-column prompt template" in plain


def test_a_sampling_generation_config_sets_the_parameters(tok):
    from transformers import GenerationConfig

    from tasks.exporters.gguf.modelfile import Sampling

    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=40)
    text = _modelfile(tok, sampling=Sampling.of(config, 64, 512))
    assert text.endswith("PARAMETER temperature 0.7\nPARAMETER top_p 0.9\nPARAMETER top_k 40\n"
                         "PARAMETER num_predict 64\nPARAMETER num_ctx 512\n")


# -- the export stage -----------------------------------------------------------------------

from test_exporters import trained  # noqa: E402,F401  (the shared trained run)


def _with_mlflow_run(project: Path) -> str:
    """The MLflow run the train stage would have opened (train_here runs without one), on the
    project's own SQLite store: the export logs into it and registers from it."""
    from finetune.files import write_json_atomic
    from finetune.workspace import Workspace
    from tasks import tracking

    ws = Workspace.load(project / "params/default.yaml")
    run_id = tracking.start_run(ws)
    write_json_atomic(ws.layout.train_run, {"mlflow_run_id": run_id})
    return run_id


@pytest.fixture(scope="module")
def gguf_export(trained, tmp_path_factory):
    """export.gguf [f16] on the shared LoRA run, with an MLflow run to tag and register."""
    from helpers import stages_here, write_params

    project = tmp_path_factory.mktemp("gguf") / "p"
    shutil.copytree(trained, project, symlinks=True)
    write_params(project, {"export.gguf": ["f16"]})
    run_id = _with_mlflow_run(project)
    stages_here(project, "export")
    return project, run_id


def test_export_writes_the_gguf_files_a_manifest_and_a_modelfile(gguf_export):
    from finetune.files import file_sha256

    project, _ = gguf_export
    folder = project / "data/export/gguf"
    assert sorted(p.name for p in folder.iterdir()) == [
        "Modelfile", "finetune-default-f16.gguf", "finetune-default-lora-f16.gguf",
        "manifest.json"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(e["file"], e["kind"], e["type"]) for e in manifest] == [
        ("finetune-default-f16.gguf", "model", "f16"),
        ("finetune-default-lora-f16.gguf", "lora", "f16")]
    for e in manifest:
        assert e["sha256"] == file_sha256(folder / e["file"])
        assert e["size"] == (folder / e["file"]).stat().st_size
    fields, tensors = _read(folder / "finetune-default-lora-f16.gguf")
    assert fields["adapter.lora.alpha"] == pytest.approx(32.0)  # params/default.yaml's
    assert len(tensors) == 5 * 7 * 2  # all-linear: 7 modules a layer, A and B each
    modelfile = (folder / "Modelfile").read_text()
    assert "FROM ./finetune-default-f16.gguf\n" in modelfile
    assert 'TEMPLATE """Question: {{ .Prompt }}\nAnswer:"""' in modelfile
    assert 'PARAMETER stop "</s>"' in modelfile and "PARAMETER num_predict 32\n" in modelfile
    card = (project / "data/export/README.md").read_text()
    for e in manifest:
        assert f"| `{e['file']}` |" in card and e["sha256"] in card
    # a completion run: llama.cpp's raw-prompt command, not llama-cli's chat
    assert "llama-completion -m data/export/gguf/finetune-default-f16.gguf" in card
    assert "ollama create finetune-default -f data/export/gguf/Modelfile" in card
    assert "  gguf:\n  - f16\n" in card  # the params it was written with


def test_the_run_and_the_registered_version_carry_the_gguf_sha256(gguf_export):
    from mlflow.tracking import MlflowClient

    project, run_id = gguf_export
    manifest = json.loads((project / "data/export/gguf/manifest.json").read_text())
    expected = {"gguf.types": "f16", "gguf.f16.sha256": manifest[0]["sha256"],
                "gguf.lora.f16.sha256": manifest[1]["sha256"]}
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run_tags = client.get_run(run_id).data.tags
    assert {k: run_tags.get(k) for k in expected} == expected
    record = json.loads((project / "data/lineage/model_version.json").read_text())
    version = client.get_model_version_by_alias(record["name"], "candidate")
    assert {k: version.tags.get(k) for k in expected} == expected


def test_a_type_the_model_cannot_encode_is_one_line_and_keeps_the_export(gguf_export,
                                                                         tmp_path):
    """q8_0 on stories260K: its MLP is 172 wide, not a multiple of q8_0's block of 32. The CLI
    (exit 2, one line) and the previous data/export as it was."""
    from helpers import error_line, run_cli, write_params

    project = Path(shutil.copytree(gguf_export[0], tmp_path / "p", symlinks=True))
    before = {p: p.read_bytes() for p in (project / "data/export").rglob("*") if p.is_file()}
    write_params(project, {"export.gguf": ["f16", "q8_0"]})
    line = error_line(run_cli(project, "stage", "export"))
    assert line == ("error: export.gguf: q8_0 cannot encode blk.0.ffn_down.weight: its rows of "
                    "172 are not a multiple of Q8_0's block of 32; list f32, f16 or bf16 for "
                    "this model"), line
    after = {p: p.read_bytes() for p in (project / "data/export").rglob("*") if p.is_file()}
    assert after == before


def test_an_unmerged_run_keeps_its_adapter_folder_and_gets_the_gguf_files(trained, tmp_path):
    """export.merge_adapter false: the HF folder is the adapter as trained, and the GGUF files
    are of the model merged afterwards (the checks before any write must not merge it, which
    would unload the adapter the HF folder saves)."""
    from safetensors.torch import load_file

    from helpers import stages_here, write_params

    project = Path(shutil.copytree(trained, tmp_path / "p", symlinks=True))
    write_params(project, {"export.gguf": ["f16"], "export.merge_adapter": False})
    stages_here(project, "export")
    export = project / "data/export"
    saved = load_file(export / "adapter_model.safetensors")
    trained_adapter = load_file(project / "data/trained/adapter_model.safetensors")
    assert saved.keys() == trained_adapter.keys() and all(
        torch.equal(saved[k], trained_adapter[k]) for k in saved)
    assert sorted(p.name for p in (export / "gguf").iterdir()) == [
        "Modelfile", "finetune-default-f16.gguf", "finetune-default-lora-f16.gguf",
        "manifest.json"]


def test_export_gguf_is_listed_once_and_only_with_the_gguf_format():
    """Twice is the field's own rule; without the gguf format, a row of the compat table
    (tests/test_compat.py runs its example)."""
    from pydantic import ValidationError

    from finetune.config.export import ExportConfig

    assert ExportConfig().gguf == [] and "gguf" in ExportConfig().formats
    with pytest.raises(ValidationError, match="'f16' is listed twice"):
        ExportConfig(gguf=["f16", "q8_0", "f16"])
