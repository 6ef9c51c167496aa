"""`finetune serve`: the champion on an OpenAI-compatible server (transformers serve behind a
small proxy) answers the real `openai` client, its greedy completions equal the evaluate
stage's generations for the same prompts, and Ctrl-C stops it; a port in use, a missing
version, a folder that is no model and a model that does not fit are one line and exit 2.
The registered model is test_publish's fixture (train stage, evaluate, export: v1 promoted).

`--gguf TYPE` serves the export's GGUF file with llama-cpp-python's server (the optional
`serve-gguf` extra, which compiles llama.cpp, so not in `make setup`): its test needs
llama_cpp and is skipped without it; the one-line refusal without llama_cpp always runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import BIN
from test_publish import registered  # noqa: F401 - the fixture, built once per module

from flows.cli import main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(proc: subprocess.Popen, said: str, timeout: float = 300) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if said in line:
            return lines
    raise AssertionError(f"no '{said}' from finetune serve:\n{''.join(lines)}")


@pytest.mark.slow
def test_the_champion_answers_the_openai_client_as_the_evaluate_stage_did(registered):  # noqa: F811
    from openai import BadRequestError, OpenAI

    port = _free_port()
    proc = subprocess.Popen([str(BIN / "finetune"), "serve", "--port", str(port)],
                            cwd=registered, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = _wait_for(proc, "OpenAI-compatible server at")
        assert lines[0].startswith("[serve] models:/finetune-default/1 "
                                   "(models:/finetune-default@champion)"), lines[0]
        curl = _wait_for(proc, "curl ")[-1]
        assert f"http://127.0.0.1:{port}/v1/completions" in curl
        engine = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "serve" in " ".join(p.cmdline())]
        assert engine, "no transformers serve process"

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["finetune-default-v1"]
        samples = json.loads((registered / "data/eval/samples.json").read_text())
        max_tokens = 32  # tests/helpers.TINY's eval.generation_max_new_tokens
        assert len(samples) == 2
        for i, row in enumerate(samples):  # the second without max_tokens: the run's 32
            length = {"max_tokens": max_tokens} if i == 0 else {}
            reply = client.completions.create(model="finetune-default-v1", prompt=row["prompt"],
                                              temperature=0, **length)
            assert reply.choices[0].text == row["generation"], row["prompt"]
            assert reply.model == "finetune-default-v1"
        stream = client.completions.create(model="finetune-default-v1",
                                           prompt=samples[0]["prompt"], max_tokens=max_tokens,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == \
            samples[0]["generation"]
        with pytest.raises(BadRequestError, match="no chat template"):
            client.chat.completions.create(model="finetune-default-v1", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])

        # the port is taken now: a second server is one line
        second = subprocess.run([str(BIN / "finetune"), "serve", "--port", str(port)],
                                cwd=registered, capture_output=True, text=True)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: --port {port}: 127.0.0.1:{port} is in use (Address already in use); "
            "choose another with --port"]

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert f"[serve] stopped the server at http://127.0.0.1:{port}" in out
        assert not [p for p in engine if p.is_running() and p.status() != "zombie"]
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))  # free again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serve(project: Path, capsys, *args: str) -> tuple[int, str]:
    code = main(["serve", *args, "-p", str(project / "params/default.yaml")])
    return code, capsys.readouterr().err


def test_what_cannot_be_served_is_one_line_before_anything_starts(project, tmp_path, capsys):
    code, err = serve(project, capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: MODEL 'models:/finetune-default@champion': not in the model registry at "
        f"sqlite:///{project / 'mlflow.db'} (there is no MLflow database yet: run the "
        "pipeline first)"]
    code, err = serve(project, capsys, str(tmp_path / "nothing"))
    assert code == 2 and "no such folder" in err and len(err.strip().splitlines()) == 1
    code, err = serve(project, capsys, str(tmp_path))
    assert code == 2 and "has no config.json" in err and len(err.strip().splitlines()) == 1

    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text("{}")
    with open(big / "model.safetensors", "wb") as fh:  # sparse: its size, not its disk
        fh.truncate(2 * psutil.virtual_memory().total)
    code, err = serve(project, capsys, str(big))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not fit: its weights are" in err and "GiB of memory is available" in err

    code, err = serve(project, capsys, str(project / "data/models/stories260K"), "--gguf",
                      "q8_0")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--gguf q8_0: " in err and "has no GGUF file of that type (it has no GGUF files: " \
        "list types in export.gguf and rerun the export stage)" in err, err


def gguf_export(src: Path, dest: Path, *types: str) -> Path:
    """A copy of the model folder `src` with GGUF files as the export stage writes them
    (tasks/exporters/gguf: `gguf/NAME-<type>.gguf` by model_file.write_model, with the
    tokenizer's chat template and the generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.exporters.gguf.model_file import write_model

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("gguf", "adapter"))
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(dest)
    (dest / "gguf").mkdir()
    for file_type in types:
        write_model(model, tokenizer, dest / "gguf" / f"finetune-default-{file_type}.gguf",
                    file_type, chat_template=getattr(tokenizer, "chat_template", None),
                    generation_config=model.generation_config, name="finetune-default")
    return dest


def test_gguf_without_llama_cpp_is_one_line_before_anything_starts(project, tmp_path, capsys,
                                                                   monkeypatch):
    # named as the export stage names them; their bytes are not read before these refusals
    folder = tmp_path / "model"
    (folder / "gguf").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    for name in ("finetune-default-f32.gguf", "finetune-default-lora-f16.gguf"):
        (folder / "gguf" / name).write_bytes(b"GGUF")
    port = _free_port()
    # llama-cpp-python absent, whether or not this machine has it: `import llama_cpp` fails
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    code, err = serve(project, capsys, str(folder), "--gguf", "f32", "--port", str(port))
    assert code == 2 and err.strip().splitlines() == [
        "error: --gguf: serving finetune-default-f32.gguf needs llama-cpp-python's server, "
        "which is not installed: pip install -e '.[serve-gguf]' "
        "(llama-cpp-python[server]==0.3.36; it compiles llama.cpp, about 16 minutes on 2 cores)"]
    with socket.socket() as sock:  # nothing started: the port was never bound
        sock.bind(("127.0.0.1", port))

    code, err = serve(project, capsys, str(folder), "--gguf", "q4_k_m")
    assert code == 2 and err.strip().splitlines() == [
        f"error: --gguf q4_k_m: {folder} has no GGUF file of that type (its types: f32)"]

    from finetune.errors import PipelineError
    from tasks.serve import gguf_chat_template

    with pytest.raises(PipelineError, match="is not a GGUF file llama.cpp can read"):
        gguf_chat_template(folder / "gguf/finetune-default-f32.gguf")  # 4 bytes: a cut file


LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP, reason="llama-cpp-python is not installed: "
                    "pip install -e '.[serve-gguf]' (compiles llama.cpp, ~16 min on 2 cores)")
def test_the_gguf_file_answers_the_openai_client_as_llama_cpp_decodes_it(registered, tmp_path):  # noqa: F811
    """The oracle is llama.cpp itself on the same file, decoding greedily by hand (the argmax
    of its logits token by token, no sampler chain): the server must add nothing of its own
    (llama-cpp-python's defaults would sample at temperature 0.8 with a 1.1 repeat penalty).
    The prompt is the evaluate stage's, and llama.cpp encodes it to the same ids as the
    tokenizer the evaluate stage used. (Its generations, from float32 torch, are not the
    oracle: another implementation may break a near-tie of two logits the other way.)"""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    from openai import BadRequestError, OpenAI
    from transformers import AutoTokenizer

    folder = gguf_export(registered / "data/export", tmp_path / "export", "f32", "f16")
    samples = json.loads((registered / "data/eval/samples.json").read_text())
    max_tokens = 32  # tests/helpers.TINY's eval.generation_max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf = folder / "gguf/finetune-default-f32.gguf"
    llm = Llama(model_path=str(gguf), n_ctx=0, verbose=False)
    expected = []
    for row in samples:
        ids = llm.tokenize(row["prompt"].encode(), add_bos=True, special=True)
        assert ids == tokenizer(row["prompt"])["input_ids"], row["prompt"]
        llm.reset()
        llm.eval(ids)
        out = []
        while len(out) < max_tokens:
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last token's
            token = int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
            if token == llm.token_eos():
                break
            out.append(token)
            llm.eval([token])
        expected.append(llm.detokenize(out, prev_tokens=ids).decode("utf-8", errors="ignore"))
    llm.close()

    port = _free_port()
    proc = subprocess.Popen([str(BIN / "finetune"), "serve", str(folder), "--gguf", "f32",
                             "--port", str(port)],
                            cwd=registered, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = _wait_for(proc, "OpenAI-compatible server at")
        assert "starting llama.cpp's server (python -m llama_cpp.server) on " \
            "finetune-default-f32.gguf" in lines[0], lines
        assert "no chat template (a completion run)" in lines[-1], lines
        _wait_for(proc, "curl ")
        engine = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "llama_cpp.server" in " ".join(p.cmdline())]
        assert engine, "no llama_cpp.server process"

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["export"]
        for i, (row, text) in enumerate(zip(samples, expected)):
            # the second as a client that sets nothing: the model's greedy default, the run's 32
            asked = {"max_tokens": max_tokens, "temperature": 0} if i == 0 else {}
            reply = client.completions.create(model="export", prompt=row["prompt"], **asked)
            assert reply.choices[0].text == text, (row["prompt"], reply.choices[0].text)
        stream = client.completions.create(model="export", prompt=samples[0]["prompt"],
                                           max_tokens=max_tokens, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected[0]
        with pytest.raises(BadRequestError, match="no chat template"):
            client.chat.completions.create(model="export", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert f"[serve] stopped the server at http://127.0.0.1:{port}" in out
        assert not [p for p in engine if p.is_running() and p.status() != "zombie"]
    finally:
        if proc.poll() is None:  # a failed assertion: the engine too, not left behind
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def test_tool_calls_in_a_reply_text_become_openai_tool_calls():
    from tasks.serve import with_tool_calls

    text = 'Let me look. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    reply = with_tool_calls({"choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}},
        {"index": 1, "finish_reason": "stop", "message": {"role": "assistant",
                                                          "content": "It is 5."}}]})
    first, second = reply["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"] == [{"id": "call_0", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    assert second["finish_reason"] == "stop" and "tool_calls" not in second["message"]


def test_a_streamed_reply_gets_its_tool_calls_before_its_last_event():
    from tasks.serve import ToolCallStream

    def sse(chunks):
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
            b"data: [DONE]\n\n"

    def delta(text, finish=None):
        return {"id": "r", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {"content": text}, "finish_reason": finish}]}

    pieces = ['<tool_call>{"name": "add", ', '"arguments": {"a": 2}}', "</tool_call>"]
    raw = sse([delta(p) for p in pieces] + [delta("", "stop")])
    stream = ToolCallStream()
    out = b"".join(stream.feed(raw[i:i + 7]) for i in range(0, len(raw), 7))  # odd cuts
    events = [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "".join(pieces)
    calls, last = chunks[-2]["choices"][0], chunks[-1]["choices"][0]
    assert calls["delta"]["tool_calls"] == [{"index": 0, "id": "call_0", "type": "function",
                                             "function": {"name": "add",
                                                          "arguments": '{"a": 2}'}}]
    assert last["finish_reason"] == "tool_calls"

    plain = sse([delta("It is "), delta("5.", "stop")])
    assert ToolCallStream().feed(plain) == plain  # no calls: the bytes as they came
