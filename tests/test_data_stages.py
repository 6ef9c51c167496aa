"""download -> format -> tokenize on real GSM8K rows and small hand-made files."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.download import download
from tasks.format import format_prompts
from finetune.datatypes.encoding import IGNORE_INDEX
from tasks.tokenize import tokenize

from helpers import ROOT, copy_project, run_cli, stages_here, train_in_place, write_params


def ws_for(project, overrides=None):
    if overrides:
        write_params(project, overrides)
    return Workspace.load(project / "params/default.yaml")


def local_source(project, rows, name="src.jsonl", **extra):
    path = project / "data/source" / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".csv"):
        pd.DataFrame(rows).to_csv(path, index=False)
    return {"data.data_files": None, "data.json_file_path": f"data/source/{name}", **extra}


def test_default_source_flows_through_three_stages(project):
    ws = ws_for(project)
    raw = download(ws)
    train = pd.read_parquet(raw["train"])
    assert len(train) == 48 and {"question", "answer"} <= set(train.columns)
    assert len(pd.read_parquet(raw["test"])) == 16
    fmt = format_prompts(ws)
    f = pd.read_parquet(fmt["train"])
    assert f.prompt[0].startswith("Question: ") and f.prompt[0].endswith("\nAnswer:")
    assert f.completion[0].startswith(" ") and "####" in f.completion[0]
    tok = tokenize(ws)
    import datasets

    ds = datasets.load_from_disk(str(tok["train"]))
    row = ds[0]
    assert len(row["input_ids"]) == len(row["labels"]) <= 256
    n_prompt = next(i for i, lab in enumerate(row["labels"]) if lab != IGNORE_INDEX)
    assert row["input_ids"][0] == 1  # BOS, as the Llama tokenizer adds it
    assert all(lab == IGNORE_INDEX for lab in row["labels"][:n_prompt])
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    untruncated = next(r for r in ds if not r["truncated"])
    assert untruncated["input_ids"][-1] == 2 and untruncated["labels"][-1] == 2  # EOS trained
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert stats["train"]["rows"] == len(ds)
    first = {p.relative_to(project): p.read_bytes() for p in tok["train"].parent.rglob("*") if p.is_file()}
    tokenize(ws)  # same inputs -> byte-identical folder (DVC hash stable across reruns/clones)
    again = {p.relative_to(project): p.read_bytes() for p in tok["train"].parent.rglob("*") if p.is_file()}
    assert again == first
    assert stats["train"]["trainable_tokens"] == sum(ds["n_trainable"])
    assert stats["train"]["truncated_rows"] == sum(ds["truncated"])


@pytest.mark.parametrize("name", ["src.jsonl", "src.json", "src.csv"])
def test_local_formats_and_split_ratio(project, name):
    rows = [{"q": f"what is {i}?", "a": str(i)} for i in range(40)]
    ws = ws_for(project, local_source(project, rows, name, **{
        "data.prompt_template": "Q: {q}", "data.completion_template": " {a}",
        "data.split_ratio": 0.75, "data.max_train_samples": None, "data.max_eval_samples": None}))
    out = download(ws)
    train, test = pd.read_parquet(out["train"]), pd.read_parquet(out["test"])
    assert (len(train), len(test)) == (30, 10)  # split_ratio: the fraction kept for training
    assert set(train.q) & set(test.q) == set()
    again = download(ws)  # seeded: same split twice
    assert pd.read_parquet(again["test"]).q.tolist() == test.q.tolist()


def test_prompt_func_and_text_mode(project, monkeypatch):
    mod = project / "my_prompts.py"
    mod.write_text("def prompt(row):\n    return 'Q: ' + row['q']\n"
                   "def completion(row):\n    return ' ' + row['a']\n")
    monkeypatch.syspath_prepend(str(project))
    rows = [{"q": f"q{i}", "a": f"a{i}"} for i in range(20)]
    ws = ws_for(project, local_source(project, rows, **{
        "data.prompt_template": None, "data.completion_template": None,
        "data.prompt_func": "my_prompts:prompt", "data.completion_func": "my_prompts:completion"}))
    download(ws)
    f = pd.read_parquet(format_prompts(ws)["train"])
    assert f.prompt.str.startswith("Q: q").all() and f.completion.str.startswith(" a").all()

    text_rows = [{"id": i, "text": f"once upon a time {i}"} for i in range(20)]
    ws = ws_for(project, local_source(project, text_rows, "plain.jsonl", **{
        "data.prompt_func": None, "data.completion_func": None}))
    download(ws)
    f = pd.read_parquet(format_prompts(ws)["train"])
    assert (f.prompt == "").all() and f.completion.str.startswith("once upon").all()
    ds_path = tokenize(ws)["train"]
    import datasets

    row = datasets.load_from_disk(str(ds_path))[0]
    assert row["labels"][0] == IGNORE_INDEX and row["labels"][1:] == row["input_ids"][1:]


def test_prompt_func_by_path_as_the_seeds_write_it(project, monkeypatch):
    """seed 004's `preprocess/alpaca_func:create_alpaca_prompt`: a file of the project, not an
    importable module; a missing file or name is one line naming the key."""
    (project / "preprocess/qa_func.py").write_text(  # next to the shipped alpaca_func.py
        "def create_qa_prompt(row):\n    return 'Instruction: ' + row['q']\n")
    monkeypatch.chdir(project)  # stages run in the project root
    rows = [{"q": f"q{i}", "a": f"a{i}"} for i in range(20)]
    ws = ws_for(project, local_source(project, rows, **{
        "data.prompt_template": None,
        "data.prompt_func": "preprocess/qa_func:create_qa_prompt",
        "data.completion_template": " {a}"}))
    download(ws)
    f = pd.read_parquet(format_prompts(ws)["train"])
    assert f.prompt.str.startswith("Instruction: q").all()
    from finetune.imports import load_object

    with pytest.raises(PipelineError, match=r"^data.prompt_func: cannot import "
                       r"'preprocess/nope:f' \(no file .*preprocess/nope.py\)$"):
        load_object("preprocess/nope:f", "data.prompt_func")
    with pytest.raises(PipelineError, match=r"module '.*' has no attribute 'missing'"):
        load_object("preprocess/qa_func.py:missing", "data.prompt_func")


def test_zero_trainable_rows_dropped_then_fail_above_fraction(project):
    rows = [{"q": "word " * (300 if i < 3 else 5), "a": "yes"} for i in range(30)]
    over = local_source(project, rows, **{"data.prompt_template": "{q}",
                                          "data.completion_template": " {a}",
                                          "data.max_seq_length": 64,
                                          "data.max_dropped_fraction": 0.2})
    ws = ws_for(project, over)
    download(ws), format_prompts(ws), tokenize(ws)
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    dropped = stats["train"]["dropped_rows"] + stats.get("test", {}).get("dropped_rows", 0)
    assert dropped == 3
    ws = ws_for(project, {"data.max_dropped_fraction": 0.01})
    with pytest.raises(PipelineError, match=r"3/27 rows have no trainable token.*data.max_dropped_fraction 0.01"):
        tokenize(ws)


BAD_INPUTS = [
    ({"data.data_files": {"train": "data/source/missing.jsonl"}}, "download",
     "data/source/missing.jsonl not found"),
    ({"data.prompt_template": "Q: {questio}\nA:"}, "download",
     "column 'questio' named by the prompt/completion template is missing"),
    ({"model.name_or_path": "./no/such/model"}, "tokenize", "local folder"),
    ({"model.name_or_path": "HuggingFaceTB/SmolLM-135M"}, "tokenize", "HF_HUB_OFFLINE"),
    ({"data.max_seq_length": 1024}, "tokenize", "exceeds the model's max_position_embeddings 512"),
    ({"data.max_seq_length": 8}, "tokenize", "no trainable token"),
    ({"data.dataset_name": "openai/gsm8k", "data.data_files": None}, "download", "HF_HUB_OFFLINE"),
    ({"distributed.nproc_per_node": 2}, "train", "strategy 'single' runs one process"),
    ({"training.mixed_precision": "fp16"}, "train", "fp16 needs a CUDA GPU"),
    ({"model.load_in_4bit": True}, "train", "needs a CUDA GPU"),
    ({"data.test_split": "validation"}, "download",
     "data.test_split 'validation' not found (splits: train, test)"),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A project whose data stages already ran with good params (copied per case)."""
    project = copy_project(tmp_path_factory.mktemp("prepared") / "p")
    stages_here(project, "download", "format", "tokenize")
    return project


@pytest.mark.parametrize("overrides, stage, expected", BAD_INPUTS,
                         ids=[b[2][:30] for b in BAD_INPUTS])
def test_bad_input_is_one_line_and_keeps_previous_outputs(prepared, tmp_path, overrides, stage,
                                                          expected):
    import shutil

    project = tmp_path / "p"
    shutil.copytree(prepared, project, symlinks=True)
    before = {p: p.read_bytes() for p in (project / "data").rglob("*")
              if p.is_file() and "/source/" not in str(p)}
    write_params(project, overrides)
    # the stage function in this process (the CLI's exit code and one error: line for a
    # PipelineError are tests/test_cli.py's): one line, and nothing written
    with pytest.raises(PipelineError) as refused:
        stages_here(project, stage)
    line = str(refused.value)
    assert "\n" not in line and expected in line, line
    after = {p: p.read_bytes() for p in before if p.exists()}
    assert after == before, "a failing stage changed earlier outputs"


def test_empty_dataset_and_null_column(project):
    (project / "data/source/empty.jsonl").write_text("")
    ws = ws_for(project, {"data.data_files": None, "data.json_file_path": "data/source/empty.jsonl"})
    with pytest.raises(PipelineError, match="no rows|cannot parse"):
        download(ws)
    rows = [{"question": "q", "answer": "a"}] * 10 + [{"question": None, "answer": "a"}]
    ws = ws_for(project, local_source(project, rows, **{"data.split_ratio": 0.9}))
    with pytest.raises(PipelineError, match=r"column 'question' row \d+ fails not_nullable"):
        download(ws)


def test_format_names_row_of_failing_func(project, monkeypatch):
    mod = project / "bad_prompts.py"
    mod.write_text("def prompt(row):\n    return None if row['q'] == 'q7' else row['q']\n")
    monkeypatch.syspath_prepend(str(project))
    rows = [{"q": f"q{i}", "a": "a"} for i in range(10)]
    ws = ws_for(project, local_source(project, rows, **{
        "data.prompt_template": None, "data.prompt_func": "bad_prompts:prompt",
        "data.completion_template": " {a}", "data.test_split": None, "data.max_eval_samples": None}))
    download(ws)
    with pytest.raises(PipelineError, match="returned NoneType on split 'train' row 7"):
        format_prompts(ws)


TRICKY_TEXTS = ["", " ", "Hello world", "  two  spaces\tand\ttabs\n\nnewlines", "naïve café 😀 日本語",
                "ends with eos</s>", "<s>bos inside</s> and <unk>", "1,234.50 $ #### 42",
                "a" * 300, "<|endoftext|> gpt2 special", "<|pad|>x"]


def _byte_bpe():
    """A byte-level BPE fast tokenizer (the GPT-2 family), trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TRICKY_TEXTS * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")


@pytest.mark.parametrize("kind", ["stories260K", "byte-bpe", "split-special-tokens"])
def test_token_ids_equal_the_tokenizer_call(kind):
    """The stage's fast path must give exactly what `tok(texts)` gives, whatever state the
    Rust backend was left in (truncation, special-token splitting)."""
    from transformers import AutoTokenizer

    from finetune.datatypes.encoding import token_ids

    if kind == "stories260K":
        tok = AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")
    else:
        tok = _byte_bpe()
    if kind == "split-special-tokens":
        tok.split_special_tokens = True
    assert tok.is_fast
    expected = tok(TRICKY_TEXTS, add_special_tokens=False)["input_ids"]
    backend = tok.backend_tokenizer  # leave it in the other state than the call expects
    backend.enable_truncation(max_length=3)
    backend.encode_special_tokens = not tok.split_special_tokens
    assert token_ids(tok, TRICKY_TEXTS) == expected
    assert any(len(ids) > 3 for ids in expected)
    if kind == "split-special-tokens":
        assert token_ids(tok, ["<|endoftext|>"]) != [[tok.eos_token_id]]
    elif kind == "byte-bpe":
        assert token_ids(tok, ["<|endoftext|>"]) == [[tok.eos_token_id]]


#: seed 004's Alpaca example block, exactly as the document writes it
SEED_004_BLOCK = """\
dataset:
  tokenizer_name: "meta-llama/Llama-3.2-1B"
  dataset_type: "seq_completion"
  dataset_name: "yahma/alpaca-cleaned"
  train_split: "train"
  test_split: "test"
  max_seq_length: 512
  prompt_func: "preprocess/alpaca_func:create_alpaca_prompt"
  completion_template: "{output}"
"""
#: and its prompt function file (preprocess/alpaca_func.py), as the document gives it
SEED_004_PROMPT_FUNC = """\
def prompt_no_input(row):
    return ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\\n\\n"
            "### Instruction:\\n{instruction}\\n\\n### Response:\\n").format_map(row)


def prompt_input(row):
    return ("Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\\n\\n"
            "### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n### Response:\\n").format_map(row)


def create_alpaca_prompt(row):
    return prompt_no_input(row) if row["input"] == "" else prompt_input(row)
"""


def test_the_seed_004_alpaca_block_pasted_verbatim_trains(tmp_path):
    """Seed 004's block in place of our data section (`dataset:`, seq_completion, the
    tokenizer in the dataset section, the prompt function by path clashing with no default),
    only dataset_name pointed at a local Alpaca-shaped file and tokenizer_name at the local
    model; its test split is missing from the file, so split_ratio's 0.8 is kept for
    training. One empty output among the rows is dropped and counted."""
    import yaml

    project = copy_project(tmp_path / "p")
    rows = [{"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 2 else f"n={i}",
             "output": "" if i == 5 else f"{2 * i + 1}"} for i in range(80)]
    (project / "data/alpaca.json").write_text(json.dumps(rows))  # a JSON array, as Alpaca's
    (project / "preprocess/alpaca_func.py").write_text(SEED_004_PROMPT_FUNC)
    params = yaml.safe_load((project / "params/default.yaml").read_text())
    del params["data"]
    params["training"]["max_steps"] = 2
    block = (SEED_004_BLOCK.replace("yahma/alpaca-cleaned", "data/alpaca.json")
             .replace("meta-llama/Llama-3.2-1B", "data/models/stories260K"))
    (project / "params/default.yaml").write_text(yaml.safe_dump(params) + block)
    assert run_cli(project, "validate").returncode == 0
    stages_here(project, "download", "format", "tokenize")
    # the training job in this process (the one the stage hands torchrun): the block is
    # under test, not the process boundary (through the stage: a torchrun start, ~12 s)
    train_in_place(project)
    train = pd.read_parquet(project / "data/formatted/train.parquet")
    test = pd.read_parquet(project / "data/formatted/test.parquet")
    counts = json.loads((project / "data/metrics/format.json").read_text())
    assert len(train) + len(test) == 79 and counts["train"]["rows"] + counts["test"]["rows"] == 79
    assert counts["train"]["dropped_rows"] + counts["test"]["dropped_rows"] == 1
    assert counts["train"]["rows"] + counts["train"]["dropped_rows"] == 64  # 0.8 of 80
    assert train.prompt.str.startswith("Below is an instruction").all()
    assert train.prompt.str.contains("### Input:").any()
    assert train.prompt.str.endswith("### Response:\n").all()
    metrics = json.loads((project / "data/metrics/train.json").read_text())
    assert metrics["global_step"] == 2


def test_split_slices_as_datasets_writes_them(project):
    rows = [{"q": f"q{i}", "a": str(i)} for i in range(40)]
    test_rows = [{"q": f"t{i}", "a": str(i)} for i in range(20)]
    local_source(project, rows, "tr.jsonl")
    (project / "data/source/te.jsonl").write_text(
        "\n".join(json.dumps(r) for r in test_rows) + "\n")
    base = {"data.json_file_path": None, "data.prompt_template": "{q}",
            "data.completion_template": " {a}", "data.max_train_samples": None,
            "data.max_eval_samples": None,
            "data.data_files": {"train": "data/source/tr.jsonl", "test": "data/source/te.jsonl"}}
    ws = ws_for(project, {**base, "data.train_split": "train[10:20]",
                          "data.test_split": "test[:25%]"})
    out = download(ws)
    train, test = pd.read_parquet(out["train"]), pd.read_parquet(out["test"])
    assert train.q.tolist() == [f"q{i}" for i in range(10, 20)]
    assert test.q.tolist() == [f"t{i}" for i in range(5)]
    ws = ws_for(project, {**base, "data.train_split": "train[:50%]+test[-2:]"})
    train = pd.read_parquet(download(ws)["train"])
    assert train.q.tolist() == [f"q{i}" for i in range(20)] + ["t18", "t19"]
    ws = ws_for(project, {**base, "data.train_split": "train[:1000"})
    with pytest.raises(PipelineError, match=r"^data.train_split 'train\[:1000': not a split or "
                       "slice datasets can read"):
        download(ws)


def test_input_columns_are_what_the_functions_receive_and_are_required(project, monkeypatch):
    (project / "preprocess/cols_func.py").write_text(
        "def prompt(row):\n    return 'Q: ' + ','.join(sorted(row))\n")
    monkeypatch.chdir(project)
    rows = [{"q": f"q{i}", "a": f"a{i}", "extra": i} for i in range(20)]
    over = {"data.prompt_template": None, "data.prompt_func": "preprocess/cols_func:prompt",
            "data.completion_template": " {a}", "data.input_columns": ["q", "a"]}
    ws = ws_for(project, local_source(project, rows, **over))
    download(ws)
    assert (pd.read_parquet(format_prompts(ws)["train"]).prompt == "Q: a,q").all()
    ws = ws_for(project, local_source(project, rows, **{**over,
                                                         "data.input_columns": ["q", "nope"]}))
    with pytest.raises(PipelineError, match="column 'nope' named by the prompt/completion"):
        download(ws)
