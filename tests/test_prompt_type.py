"""Prompt-only rows (data.dataset_type: prompt, finetune/datatypes/prompt.py), the data of an
online method (grpo): a prompt from templates, a string or a conversation, no trained token, and
every other column of the row kept for the reward functions, through format, tokenize and the
stream; sft refuses them in one line."""

from __future__ import annotations

import json
import os

import datasets
import pandas as pd
import pytest

from helpers import ROOT, copy_project, stages_here, write_params
from test_chat import PLAIN
from finetune.config.data import DataConfig
from finetune.datatypes import DataContext
from finetune.datatypes.chat import render
from finetune.datatypes.encoding import IGNORE_INDEX
from finetune.errors import PipelineError

GSM8K = {"prompt_template": "Question: {question}\nAnswer:", "completion_template": " {answer}"}
#: a method that trains on prompt-only rows, registered by the tests that run stages (grpo's
#: facts are the grpo method's own; this file tests the rows, not the method)
ONLINE = "online-test"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")


@pytest.fixture
def ctx(tok):
    return DataContext(ROOT, lambda: tok)


@pytest.fixture
def online_method():
    from finetune.config import methods

    methods.register_method(methods.Method(ONLINE, accepts=("none",)))
    try:
        yield ONLINE
    finally:
        del methods._METHODS[ONLINE]


def prompt_type(**keys):
    return DataConfig(json_file_path="x.jsonl", dataset_type="prompt", **keys).datatype


def from_parquet(frame: pd.DataFrame, tmp_path) -> pd.DataFrame:
    """The frame as the format stage reads it (numpy arrays and scalars)."""
    frame.to_parquet(tmp_path / "raw.parquet", index=False)
    return pd.read_parquet(tmp_path / "raw.parquet")


def gsm8k(n: int) -> pd.DataFrame:
    return pd.read_json(ROOT / "data/source/gsm8k/train.jsonl", lines=True).head(n)


def test_gsm8k_rows_keep_their_answer_for_the_rewards_and_train_no_token(tok, ctx):
    datatype = prompt_type(**GSM8K)
    assert datatype.required_columns() == ["question", "answer"]
    raw = gsm8k(4)
    raw.loc[3, "answer"] = ""  # a reference only: an empty one keeps the row
    formatted = datatype.format(raw, "train", ctx)
    assert formatted.dropped == [] and list(formatted.rows.columns) == [
        "prompt", "completion", "reward_inputs"]
    rows = formatted.rows
    for (q, a), prompt, completion, inputs in zip(raw[["question", "answer"]].values,
                                                  rows.prompt, rows.completion,
                                                  rows.reward_inputs):
        assert prompt == f"Question: {q}\nAnswer:" and completion == f" {a}"
        assert inputs == json.dumps({"answer": a, "prompt": prompt, "question": q},
                                    sort_keys=True, ensure_ascii=False)
    from finetune.datatypes.contract import check_frame

    check_frame(datatype.formatted_schema(), rows, "format split 'train'")
    eval_rows = datatype.eval_rows(rows)
    assert eval_rows.reference.tolist() == rows.completion.tolist()

    fn, kwargs = datatype.encoder(ctx)
    enc = fn(rows.to_dict("list"), tok=tok, **kwargs)
    assert set(enc) == {"input_ids", "labels", "n_trainable", "truncated", "reward_inputs"}
    for i, prompt in enumerate(rows.prompt):
        assert enc["input_ids"][i] == [1, *tok(prompt, add_special_tokens=False)["input_ids"]]
        assert enc["labels"][i] == [IGNORE_INDEX] * len(enc["input_ids"][i])
    assert enc["n_trainable"] == [0] * 4 and enc["truncated"] == [False] * 4
    assert enc["reward_inputs"] == rows.reward_inputs.tolist()
    # a prompt longer than max_seq_length keeps its BOS and its end (the question's last words
    # and what the model continues from), flagged like any type's row
    short = fn(rows.to_dict("list"), tok=tok, **{**kwargs, "max_len": 5})
    for whole, kept in zip(enc["input_ids"], short["input_ids"]):
        assert kept == [1, *whole[-4:]], (kept, whole)
    assert all(short["truncated"]) and short["n_trainable"] == [0] * 4
    assert short["labels"][0] == [IGNORE_INDEX] * 5


def test_a_prompt_column_of_strings_is_trls_layout(ctx, tmp_path):
    raw = from_parquet(pd.DataFrame({
        "prompt": ["What is 2 plus 3?", "  ", "Name a colour."],
        "answer": [5, 0, None], "score": [0.5, 1.0, float("nan")],
        "tags": [["sum", "small"], [], ["words"]], "meta": [{"level": 1}, {"level": 2},
                                                           {"level": 3}]}), tmp_path)
    datatype = prompt_type()
    assert datatype.required_columns() == ["prompt"]
    formatted = datatype.format(raw, "train", ctx, first_row=10)
    assert formatted.dropped == [11] and formatted.reason == "an empty prompt"
    assert formatted.rows.prompt.tolist() == ["What is 2 plus 3?", "Name a colour."]
    assert formatted.rows.completion.tolist() == ["", ""]
    assert [json.loads(x) for x in formatted.rows.reward_inputs] == [
        {"prompt": "What is 2 plus 3?", "answer": 5.0, "score": 0.5, "tags": ["sum", "small"],
         "meta": {"level": 1}},
        {"prompt": "Name a colour.", "answer": None, "score": None, "tags": ["words"],
         "meta": {"level": 3}}]
    with pytest.raises(PipelineError, match="no 'prompt' column .* set data.prompt_template"):
        datatype.format(raw.drop(columns="prompt"), "train", ctx)


def test_a_conversation_is_rendered_with_the_generation_prompt(tok, ctx, tmp_path):
    turns = [{"role": "user", "content": "What is 2 plus 3?"},
             {"role": "assistant", "content": "It is 5."},
             {"role": "user", "content": "And 4 plus 4?"}]
    raw = from_parquet(pd.DataFrame({"prompt": [turns[:1], turns], "answer": ["5", "8"]}),
                       tmp_path)
    datatype = prompt_type(chat_template=PLAIN, system_prompt="You add numbers.")
    rows = datatype.format(raw, "train", ctx).rows
    system = {"role": "system", "content": "You add numbers."}
    assert rows.prompt[0] == "You add numbers.\nUser: What is 2 plus 3?\nAssistant: "
    assert rows.prompt[1] == render(tok, PLAIN, [system, *turns], generation_prompt=True)
    assert rows.prompt[1].endswith("User: And 4 plus 4?\nAssistant: ")
    # reward functions get a conversational prompt as its messages, as TRL hands them
    assert json.loads(rows.reward_inputs[1]) == {"prompt": [system, *turns], "answer": "8"}
    assert datatype.serving_chat_template(tok, ROOT) == PLAIN


@pytest.mark.parametrize("prompt,message", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     ": the conversation does not end on a user turn"),
    ([{"role": "system", "content": "s"}], ": the conversation does not end on a user turn"),
    ([{"role": "assistant", "content": "hi"}], ": message 0 is assistant, expected user"),
    ([{"role": "robot", "content": "hi"}], " message 0: unknown role 'robot'"),
])
def test_a_conversation_that_is_not_a_prompt_is_one_line_naming_split_and_row(
        ctx, tmp_path, prompt, message):
    ok = [{"role": "user", "content": "hi"}]
    raw = from_parquet(pd.DataFrame({"prompt": [ok, prompt]}), tmp_path)
    with pytest.raises(PipelineError) as caught:
        prompt_type(chat_template=PLAIN).format(raw, "test", ctx, first_row=4)
    assert str(caught.value).startswith(f"split 'test' row 5 column 'prompt'{message}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value,message", [
    (pd.Timestamp("2024-01-01"), "Timestamp is not JSON-able"),
    (float("inf"), "inf is not a JSON number"),
    ({1: "a"}, "a mapping with keys that are not strings is not JSON-able"),
])
def test_a_column_json_cannot_hold_is_one_line_naming_split_row_and_column(ctx, value,
                                                                          message):
    raw = pd.DataFrame({"prompt": ["a", "b"], "extra": ["fine", value]})
    with pytest.raises(PipelineError, match=f"^split 'train' row 1 column 'extra': {message}; "
                       "reward functions get the row's columns as JSON"):
        prompt_type().format(raw, "train", ctx)


def test_streamed_examples_carry_the_reward_inputs(tok, ctx):
    datatype = prompt_type(**GSM8K)
    raw = gsm8k(3)
    examples = datatype.examples(raw, "train", ctx)
    rows = datatype.format(raw, "train", ctx).rows
    assert [e["reward_inputs"] for e in examples] == rows.reward_inputs.tolist()
    assert all(set(e["labels"]) == {IGNORE_INDEX} for e in examples)
    from tasks.stream import _examples  # what the stream's map keeps of each example

    chunk = _examples(raw.to_dict("list"), [0, 1, 2], datatype, ctx)
    assert chunk["reward_inputs"] == rows.reward_inputs.tolist()
    assert chunk["input_ids"] == [e["input_ids"] for e in examples]


def _config(overrides: dict):
    import yaml

    from finetune.config.loader import set_keys, validate_raw

    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    return validate_raw(set_keys(raw, overrides), source="p.yaml")


def test_sft_refuses_prompt_rows_in_one_line_and_a_method_of_prompts_takes_gsm8ks_keys(
        online_method):
    with pytest.raises(PipelineError) as caught:
        _config({"data.dataset_type": "prompt"})
    assert str(caught.value) == (
        "p.yaml: data.dataset_type: prompt holds prompts only (the method generates the "
        "completions and reward functions score them; sft has no completion to train on); "
        "set training.type: grpo")
    # the default params' GSM8K templates are this type's keys
    cfg = _config({"data.dataset_type": "prompt", "training.type": online_method})
    assert cfg.data.prompt_template == GSM8K["prompt_template"]
    assert cfg.data.completion_template == GSM8K["completion_template"]
    with pytest.raises(PipelineError, match="text_field does not apply to dataset_type prompt"):
        _config({"data.dataset_type": "prompt", "training.type": online_method,
                 "data.text_field": "question"})
    with pytest.raises(PipelineError, match="system_prompt renders a conversation in the "
                       "'prompt' column; prompt_template renders a string prompt"):
        _config({"data.dataset_type": "prompt", "training.type": online_method,
                 "data.system_prompt": "Be brief."})


def test_the_format_and_tokenize_stages_keep_the_reward_inputs(tmp_path, online_method):
    project = copy_project(tmp_path / "p", {"data.dataset_type": "prompt",
                                            "training.type": online_method})
    stages_here(project, "download", "format", "tokenize")
    raw = pd.read_parquet(project / "data/raw/train.parquet")
    formatted = pd.read_parquet(project / "data/formatted/train.parquet")
    assert list(formatted.columns) == ["prompt", "completion", "reward_inputs"]
    first = json.loads(formatted.reward_inputs[0])
    assert first == {"prompt": formatted.prompt[0], "question": raw.question[0],
                     "answer": raw.answer[0]}
    stored = datasets.load_from_disk(str(project / "data/tokenized/train"))
    assert set(stored.column_names) == {"input_ids", "labels", "n_trainable", "truncated",
                                        "reward_inputs", "length"}
    assert len(stored) == len(formatted) == 48
    assert stored["reward_inputs"] == formatted.reward_inputs.tolist()
    assert all(set(labels) == {IGNORE_INDEX} for labels in stored["labels"])
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert stats["train"]["trainable_tokens"] == 0 and stats["train"]["dropped_rows"] == 0

    # streamed, the train split is the tokenize stage's, reward inputs included
    from finetune.config import load_config
    from tasks.stream import open_train_stream

    write_params(project, {"data.streaming": True, "data.shuffle_buffer": 1})
    here = os.getcwd()
    os.chdir(project)
    try:
        streamed = list(open_train_stream(load_config(project / "params/default.yaml"),
                                          project)(0))
    finally:
        os.chdir(here)
    columns = ("input_ids", "labels", "reward_inputs")
    assert streamed == [{c: row[c] for c in columns} for row in stored]
