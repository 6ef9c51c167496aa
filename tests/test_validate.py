"""`finetune validate` (dvc.yaml's first stage) checks everything that needs no data: bad input
fails there with one line, before DVC runs, and clears the outputs of, any later stage."""

from __future__ import annotations

import pytest

from helpers import BASE, copy_project, train_here, write_params
from finetune.config import FinetuneConfig
from finetune.config.section import code_ref_keys
from flows.cli import main


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("validate") / "p")


def validate(project, capsys, monkeypatch, *overrides: str) -> tuple[int, str]:
    """`finetune validate -s ...` in this process; (exit code, its one error line or '')."""
    monkeypatch.chdir(project)  # validate works in the project; restored after the test
    code = main(["validate", *[a for o in overrides for a in ("-s", o)]])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == (code != 0), err
    return code, errors[0] if errors else ""


#: overrides as `dvc exp run -S` takes them: '+' adds a key the params file does not list
BAD = [
    # the held-out cases: each used to pass validate and fail in a later stage
    ("model.name_or_path=data/models/nope", "model.name_or_path: local folder"),
    ("model.name_or_path=someone/some-model", "'someone/some-model': cannot load: "
     "HF_HUB_OFFLINE is set"),
    ("data.max_seq_length=4096", "data.max_seq_length 4096 exceeds the model's "
     "max_position_embeddings 512"),
    ("peft.target_modules=[q_proj, nope_proj]", "peft.target_modules: 'nope_proj' is not a "
     "module of the model (its linear layers: down_proj, gate_proj, k_proj, lm_head, "
     "o_proj, q_proj, up_proj, v_proj)"),
    ("+model.load_in_4bit=true", "model.load_in_4bit: true needs a CUDA GPU"),
    ("training.mixed_precision=fp16", "training.mixed_precision: fp16 needs a CUDA GPU"),
    ("checkpoint.resume_from_checkpoint=data/checkpoints/step-0000009",
     "data/checkpoints/step-0000009 is not a complete checkpoint"),
    # what the data files' first rows tell, and the files the params name
    ("data.test_split=validation", "data.test_split 'validation' not found (splits: train, "
     "test)"),
    ("data.prompt_template='Q: {questio}'", "data split 'train': column 'questio' that "
     "data.dataset_type completion reads is missing (columns: question, answer)"),
    ("data.data_files={train: data/source/missing.jsonl}", "data/source/missing.jsonl not found"),
    ("data.prompt_func=preprocess/nowhere:f", "data.prompt_func: cannot import "
     "'preprocess/nowhere:f'"),
    ("data.dataset_type=chat", "data.chat_template: the tokenizer has no chat template"),
    ("+training.length_column_name=lenght", "training.length_column_name 'lenght' is not a "
     "column of the tokenized train split (columns: input_ids, labels, n_trainable, "
     "truncated, length)"),
    # a value of a set: the closest one
    ("scheduler.name=cosine_restart", "(did you mean 'cosine_with_restarts'?)"),
    ("optimizer.name=AdamWW", "(did you mean 'AdamW'?)"),
    ("distributed.strategy=dpp", "(did you mean 'ddp'?)"),
    # a name no exporter has (tasks/exporters), which the export stage would refuse
    ("+export.formats=[hf, adaptor]", "export.formats: unknown format 'adaptor' (did you mean "
     "'adapter'?): one of hf, adapter, quantized, gguf"),
    # a GGUF type no encoder has (tasks/exporters/gguf/quants.py)
    ("+export.gguf=[f16, q8]", "export.gguf: unknown type 'q8' (did you mean 'q8_0'?): one "
     "of f32, f16, bf16, q8_0"),
    # a type the model's tensors are no whole number of blocks of: known before training
    ("+export.gguf=[f16, q8_0]", "export.gguf: q8_0 cannot encode blk.0.ffn_down.weight: its "
     "rows of 172 are not a multiple of Q8_0's block of 32"),
    ("+export.gguf=[q4_k_m]", "export.gguf: q4_k_m cannot encode blk.0.attn_q.weight: its "
     "rows of 64 are not a multiple of Q4_K's block of 256"),
]


@pytest.mark.parametrize("override, says", BAD, ids=[b[0].split("=")[0] + b[1][:12]
                                                     for b in BAD])
def test_validate_refuses_what_a_later_stage_would(project, capsys, monkeypatch, override,
                                                   says):
    extra = (["data.prompt_template=null", "data.completion_template=null"]
             if override == "data.dataset_type=chat" else [])
    if override.startswith("data.prompt_func"):
        extra = ["data.prompt_template=null"]
    if override.startswith("+training.length_column_name"):
        extra = ["+training.group_by_length=true"]
    code, line = validate(project, capsys, monkeypatch, override, *extra)
    assert code == 2 and says in line, line


#: the code_ref fields that hold a list of references
LIST_REFS = {"grpo.tools", "rloo.tools"}


@pytest.mark.parametrize("key", code_ref_keys(FinetuneConfig))
def test_validate_loads_every_code_reference_the_fields_mark(project, capsys, monkeypatch, key):
    """Each key whose field says code_ref=True (engine/preflight.py walks them) must name
    something callable: a tuple is refused with one line naming the key."""
    # a key of a strategy's section is read with that strategy only
    extra = (["++distributed.strategy=pipeline", "++distributed.nproc_per_node=2"]
             if key.startswith("distributed.pipeline.") else [])
    listed = key in LIST_REFS  # a list of references: the item is named by its index
    value = "[finetune.config.compat:SCOPES]" if listed else "finetune.config.compat:SCOPES"
    code, line = validate(project, capsys, monkeypatch, f"++{key}={value}", *extra)
    named = f"{key}[0]" if listed else key
    assert code == 2 and line == f"error: {named}: 'finetune.config.compat:SCOPES' is not a " \
        "function", line


def test_the_code_references_are_the_user_functions():
    assert set(code_ref_keys(FinetuneConfig)) >= {
        "training.compute_loss_func", "model.model_init", "data.collate_fn"}


def test_validate_passes_the_default_and_checks_a_resume_on_another_world_size(
        project, tokenized, tmp_path, capsys, monkeypatch):
    assert validate(project, capsys, monkeypatch) == (0, "")
    run, _ = train_here(tokenized, tmp_path / "run", {
        **BASE, "training.max_steps": 2, "checkpoint.save_strategy": "steps",
        "checkpoint.save_steps": 2})
    code, line = validate(run, capsys, monkeypatch, "checkpoint.resume_from_checkpoint=true",
                          "distributed.strategy=ddp", "distributed.nproc_per_node=2")
    assert code == 2 and "has global batch 4 (per_device_train_batch_size 4 x " \
        "gradient_accumulation_steps 1 x world size 1); this run's is 8" in line, line
    code, line = validate(run, capsys, monkeypatch,
                          "checkpoint.resume_from_checkpoint=data/checkpoints/step-0000002",
                          "distributed.strategy=diloco", "distributed.nproc_per_node=2",
                          "+distributed.diloco.inner_steps=2", "+distributed.diloco.diloco_loops=1")
    assert code == 2 and "world size 1 but this run is diloco with world size 2" in line, line
    # the same global batch on two processes: resharded, so it validates
    assert validate(run, capsys, monkeypatch, "checkpoint.resume_from_checkpoint=true",
                    "distributed.strategy=ddp", "distributed.nproc_per_node=2",
                    "training.per_device_train_batch_size=2") == (0, "")
    write_params(run, {"checkpoint.resume_from_checkpoint": "data/checkpoints/step-0000002"})
    assert validate(run, capsys, monkeypatch) == (0, "")


def _broken_copy(project, name: str, line: int) -> str:
    """The shipped train split with its `line` (1-based) cut short, as `name`: a truncated
    download or a hand edit."""
    rows = (project / "data/source/gsm8k/train.jsonl").read_text().splitlines(keepends=True)
    if name.endswith(".json"):  # a JSON array, one row a line
        rows = ["[\n"] + [r.rstrip("\n") + ",\n" for r in rows[:40]] + ["{}\n", "]\n"]
    rows[line - 1] = rows[line - 1][:40] + "\n"
    (project / "data/source" / name).write_text("".join(rows))
    return f"data/source/{name}"


@pytest.mark.parametrize("command", ["validate", "stage download"])
def test_a_broken_json_line_is_named_by_file_and_line(project, capsys, monkeypatch, command):
    """Validate used to exit 1 with an internal ArrowInvalid (a 0-based row), the download
    stage 2 with a byte offset; both read a JSON file through finetune.json_input now."""
    path = _broken_copy(project, "broken.jsonl", 16)
    monkeypatch.chdir(project)
    code = main([*command.split(), "-s", f"data.data_files={{train: {path}}}",
                 "-s", "data.test_split=null"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        f"error: data file {project / path} line 16: not valid JSON (Unterminated string "
        "starting at column 14); fix or remove that line"], err
    assert not (project / "data/raw").exists(), "a failing download wrote its output"


def test_a_broken_line_of_a_json_array_is_named_too(project):
    from finetune import json_input
    from finetune.errors import PipelineError

    path = project / _broken_copy(project, "broken.json", 7)
    with pytest.raises(PipelineError, match=r"broken.json line 7: not valid JSON"):
        json_input.read_frame(path)


def test_a_tokenizer_larger_than_the_embeddings_is_refused(project, capsys, monkeypatch):
    """A tokenizer with tokens past the model's embedding rows passed validate, then training
    failed with an IndexError at the first such id. With model.added_tokens the embeddings
    grow to the tokenizer's length (engine.modeling.vocabulary), so that passes."""
    from engine.modeling.model import load_tokenizer
    from finetune.config.model import ModelConfig

    tok = load_tokenizer(ModelConfig(name_or_path="data/models/stories260K"), project)
    tok.add_tokens(["<|tool|>", "<|result|>"])
    tok.save_pretrained(project / "data/models/bigger-tokenizer")
    code, line = validate(project, capsys, monkeypatch,
                          "model.tokenizer_name_or_path=data/models/bigger-tokenizer")
    assert code == 2 and line == (
        "error: model.tokenizer_name_or_path 'data/models/bigger-tokenizer' has 514 tokens "
        "but the model 'data/models/stories260K' has 512 embedding rows (vocab_size): ids "
        "from 512 on have no embedding; use the model's own tokenizer "
        "(model.tokenizer_name_or_path: null), or name the new tokens in model.added_tokens "
        "so the embeddings grow to the tokenizer's size"), line
    code, line = validate(project, capsys, monkeypatch,
                          "model.tokenizer_name_or_path=data/models/bigger-tokenizer",
                          "model.added_tokens=['<|tool|>']")
    assert code == 0, line
