"""Chat datasets (data.dataset_type: chat, finetune/datatypes/chat.py): the loss mask is the assistant turns
with their end-of-turn marker under two templates, bad conversations are one line naming the
row, and a chat dataset runs through all six stages."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, copy_project, refused_here, stages_here, write_params
from finetune.config.data import DataConfig
from finetune.errors import PipelineError
from finetune.datatypes.chat import IGNORE_INDEX, assistant_spans, encode_chat_batch, normalise

#: ends every assistant turn with the EOS token, so generation stops there
PLAIN = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
         "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
         "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}Assistant: {% endif %}")
#: ChatML, the end-of-turn marker a text string
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "And 4 plus 4?"},
                {"role": "assistant", "content": "It is 8."}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")


def _trained_text(tok, template, last_only=False, assistant_only=True):
    enc = encode_chat_batch({"messages": [json.dumps(CONVERSATION)]}, tok, template, None,
                            4096, ["assistant"] if assistant_only else None, last_only)
    full, _ = assistant_spans(tok, template, CONVERSATION, "row 0")
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    runs, current = [], None
    for (start, end), label in zip(offsets, enc["labels"][0]):
        if label != IGNORE_INDEX:
            current = [start, end] if current is None else [current[0], end]
        elif current is not None:
            runs.append(full[current[0]:current[1]])
            current = None
    if current is not None:
        runs.append(full[current[0]:current[1]])
    return runs, enc


@pytest.mark.parametrize("template,end_of_turn", [(PLAIN, "</s>\n"), (CHATML, "<|im_end|>\n")])
def test_the_mask_is_each_assistant_turn_with_its_end_of_turn(tok, template, end_of_turn):
    runs, enc = _trained_text(tok, template)
    # exactly the turns (a word piece may carry the one space before a turn's first word)
    assert [r[1:] if r.startswith(" ") else r for r in runs] == [
        f"It is 5.{end_of_turn}", f"It is 8.{end_of_turn}"]
    if template is PLAIN:  # the EOS token itself is a trained label: the model learns to stop
        assert enc["labels"][0].count(tok.eos_token_id) == 2
    last, _ = _trained_text(tok, template, last_only=True)
    assert [r.lstrip(" ") for r in last] == [f"It is 8.{end_of_turn}"]
    every, enc = _trained_text(tok, template, assistant_only=False)
    assert enc["n_trainable"][0] == len(enc["input_ids"][0])


def test_a_template_that_rewrites_earlier_turns_cannot_mark_them(tok):
    # renders only the last user message: earlier turns differ between prefix and whole
    odd = ("{% for m in messages %}{% if loop.last or m['role'] != 'user' %}{{ m['content'] }}"
           "{% endif %}{% endfor %}")
    with pytest.raises(PipelineError, match=r"data.chat_template cannot mark turns "
                       r"in row 3 \(turn 2\)"):
        assistant_spans(tok, odd, CONVERSATION, "row 3")


@pytest.mark.parametrize("conversation,message", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}],
     "message 1: unknown role 'bot'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 1 is user, expected assistant"),
    ([{"role": "user", "content": "hi"}], "does not end on an assistant turn"),
    ([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], None),  # ShareGPT
])
def test_conversations_are_checked_naming_the_row(conversation, message):
    where = "split 'train' row 7 column 'messages'"
    if message is None:
        assert normalise(conversation, "Be brief.", where) == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
        return
    with pytest.raises(PipelineError, match=f"^{where}.*{message}"):
        normalise(conversation, None, where)


@pytest.mark.parametrize("conversation", [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
    [], None,
])
def test_a_conversation_with_nothing_to_learn_is_dropped_not_refused(conversation):
    """No messages, or an empty assistant turn anywhere: None (the format step drops and
    counts the row), where a malformed conversation is an error."""
    assert normalise(conversation, None, "split 'train' row 3 column 'messages'") is None


U, A = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
S = {"role": "system", "content": "s"}


@pytest.mark.parametrize("value,message", [
    ("{not json", ": not a list of messages (a string that is not JSON)"),
    ({"role": "user"}, ": not a list of messages"),
    ([U, "hi"], " message 1: not a mapping"),
    ([{"text": "hi"}], " message 0: has neither role/content nor from/value"),
    ([{"from": "robot", "value": "x"}], " message 0: unknown role 'robot' (system, user, "
     "assistant, tool; ShareGPT: system, human, gpt, function_call, observation)"),
    ([U, {"role": "assistant", "content": None}], " message 1: content is not a string"),
    ([S, A], ": message 1 is assistant, expected user (user and assistant alternate from a "
     "user turn, tool results follow the assistant turn that called the tools; a system "
     "message only first)"),
    ([U, A, S, A], ": message 2 is system, expected user or tool (user and assistant "
     "alternate from a user turn, tool results follow the assistant turn that called the "
     "tools; a system message only first)"),
    ([S], ": the conversation does not end on an assistant turn"),
    # refused, not dropped: order is checked before the empty assistant turn
    ([U, {"role": "assistant", "content": ""}, U], ": the conversation does not end on an "
     "assistant turn"),
])
def test_each_refusal_is_one_line_word_for_word(value, message):
    """parse, check_order and nothing_to_learn compose into normalise: every refusal as the
    format step prints it, the row first."""
    where = "split 'train' row 7 column 'messages'"
    with pytest.raises(PipelineError) as caught:
        normalise(value, None, where)
    assert str(caught.value) == where + message


def test_the_system_prompt_goes_first_only_where_there_is_none():
    import numpy as np

    assert normalise(json.dumps([U, A]), "p", "row")[0] == {"role": "system", "content": "p"}
    assert normalise(np.array([S, U, A], dtype=object), "p", "row") == [S, U, A]
    # a row with no messages is dropped even with a system prompt to add
    assert normalise("[]", "p", "row") is None


def test_keys_of_another_dataset_type_are_a_conflict():
    base = {"json_file_path": "x.jsonl"}
    with pytest.raises(ValueError, match="prompt_template does not apply to dataset_type chat"):
        DataConfig(**base, dataset_type="chat", prompt_template="{q}")
    with pytest.raises(ValueError, match="chat_template does not apply to dataset_type "
                       "completion"):
        DataConfig(**base, chat_template=PLAIN)
    assert DataConfig(**base, dataset_type="text").datatype.name == "text"


def _chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, (i * 3) % 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"It is {a + b}."}]})
    return rows


def test_a_chat_dataset_runs_through_all_six_stages(tmp_path):
    project = copy_project(tmp_path / "p")
    data = project / "data/chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _chat_rows(60)) + "\n")
    write_params(project, {"data.dataset_type": "chat",
                           "data.data_files": {"train": "data/chat.jsonl"},
                           "data.prompt_template": None,
                           "data.completion_template": None, "data.chat_template": PLAIN,
                           "data.system_prompt": "You add numbers.",
                           "data.split_ratio": 0.8})
    stages_here(project, "download", "format", "tokenize", "train", "evaluate", "export")
    import pandas as pd

    test = pd.read_parquet(project / "data/formatted/test.parquet")
    assert test["prompt"].iloc[0].startswith("You add numbers.\nUser: What is ")
    assert test["prompt"].iloc[0].endswith("\nAssistant: ")
    assert test["completion"].iloc[0].startswith("It is ")
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert stats["train"]["rows"] == 48 and stats["test"]["rows"] == 12
    assert (project / "data/export/config.json").exists()
    from transformers import AutoTokenizer  # the template it trained with, for serving
    assert AutoTokenizer.from_pretrained(project / "data/export").chat_template == PLAIN
    evaluation = json.loads((project / "data/metrics/eval.json").read_text())
    assert evaluation["finetuned"]["loss"] < evaluation["base"]["loss"]
    # a bad conversation: one line naming split, row and column; the outputs stay as they were
    rows = _chat_rows(60)
    rows[5]["messages"][1]["role"] = "robot"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stages_here(project, "download")
    before = (project / "data/formatted/train.parquet").read_bytes()
    line = refused_here(project, "format")
    assert "row" in line and "column 'messages'" in line and "unknown role 'robot'" in line, line
    assert (project / "data/formatted/train.parquet").read_bytes() == before
