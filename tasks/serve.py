"""`finetune serve [MODEL]`: a registered version (default: the champion of the default
registered model) or a model folder on an OpenAI-compatible server on 127.0.0.1, run by an
existing engine: `transformers serve` (installed with transformers) for the merged model,
llama-cpp-python's server (`python -m llama_cpp.server`, the optional `serve-gguf` extra) for
the export's GGUF file of a type (`--gguf TYPE`), given the model's generation defaults where a
request sets none (llama-cpp-python's own would sample).

The version's files are the export folder when its weights' sha256 equal the version's tags,
else its MLflow files (tasks.publish.version_folder): the merged model with the tokenizer's
chat template the run trained with and its generation_config.json, which transformers serve
reads. `/v1/completions` takes a raw prompt: asked greedily (temperature 0) with the evaluate
stage's max_new_tokens, it answers what the evaluate stage generated (tests/test_serve.py).

Checked before anything starts, each one line and exit 2: the model (a registered version
that exists, a folder with config.json), with --gguf its GGUF file of that type (else the types
it has) and llama-cpp-python (else what to install), the port (free on 127.0.0.1), the memory
(the weight files' bytes against the memory available). Ctrl-C (SIGINT) or SIGTERM stops the
server and returns 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.publish import registered_version, version_folder

#: memory the server needs beyond the weights (activations, the KV cache, the interpreter),
#: as a fraction of the weights' bytes, and at least this much
HEADROOM, MIN_HEADROOM = 0.25, 512 * 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def default_model(ws: Workspace) -> str:
    reg = ws.config.registry
    name = reg.registered_model_name or ws.config.logging.experiment_name
    return f"models:/{name}@{reg.champion_alias}"


def _resolved(ws: Workspace, target: str | None) -> tuple[Path, str, str, int]:
    """(the folder to serve, where it came from, the model's name for clients, the default
    max_tokens) for MODEL as the command line gave it. The default length is the run's
    eval.generation_max_new_tokens as its MLflow run logged it (a folder: the params')."""
    target = target or default_model(ws)
    max_tokens = ws.config.eval.generation_max_new_tokens
    if target.startswith("models:/"):
        version = registered_version(ws, target, what="MODEL")
        folder, source = version_folder(ws, version)
        if version.run_id:
            from tasks import tracking

            logged = tracking.client(ws).get_run(version.run_id).data.params
            max_tokens = int(logged.get("eval.generation_max_new_tokens", max_tokens))
        return (folder, f"{version.uri} ({target}), files in {source}",
                f"{version.name}-v{version.version}", max_tokens)
    folder = Path(target)
    if not folder.is_absolute():
        folder = Path.cwd() / folder
    if not folder.is_dir():
        raise PipelineError(f"MODEL '{target}': no such folder (give models:/NAME@ALIAS, "
                            "models:/NAME/VERSION or a model folder)")
    if not (folder / "config.json").exists():
        raise PipelineError(f"MODEL '{target}': {folder} has no config.json (a folder "
                            "from_pretrained loads: the export stage's data/export)")
    return folder, str(folder), folder.name, max_tokens


def weight_bytes(folder: Path, gguf: Path | None = None) -> int:
    """The bytes the server loads: the GGUF file, else the weight files at the folder's top
    (a merged model's; its adapter/ and gguf/ subfolders are not loaded)."""
    if gguf is not None:
        return gguf.stat().st_size
    return sum(p.stat().st_size for p in folder.iterdir()
               if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(folder: Path, gguf: Path | None = None) -> int:
    """The weights' bytes; one line when they and the headroom exceed the memory available."""
    need = weight_bytes(folder, gguf)
    total = need + max(int(need * HEADROOM), MIN_HEADROOM)
    have = available_memory()
    if total > have:
        raise PipelineError(f"MODEL {gguf or folder}: does not fit: its weights are "
                            f"{need / 2**30:.2f} GiB (+{HEADROOM:.0%} to run: "
                            f"{total / 2**30:.2f} GiB) and {have / 2**30:.2f} GiB of memory "
                            "is available")
    return need


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as the servers bind: a port a listener holds is refused, one in TIME_WAIT is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PipelineError(f"--port {port}: {host}:{port} is in use ({exc.strerror}); "
                                "choose another with --port") from None


def gguf_types(folder: Path) -> dict[str, Path]:
    """The export's merged-model GGUF files by type: the export stage's manifest.json (its
    `model` entries), else the files named as the export stage names them (NAME-<type>.gguf,
    the adapter's NAME-lora-<type>.gguf left out)."""
    import json

    gguf_dir = folder / "gguf"
    manifest = gguf_dir / "manifest.json"
    if manifest.exists():
        return {e["type"]: gguf_dir / e["file"] for e in json.loads(manifest.read_text())
                if e.get("kind") == "model" and (gguf_dir / e["file"]).exists()}
    files = sorted(gguf_dir.glob("*.gguf")) if gguf_dir.is_dir() else []
    return {f.stem.rsplit("-", 1)[-1].lower(): f for f in files
            if "-" in f.stem and not f.stem.rsplit("-", 1)[0].endswith("-lora")}


def gguf_file(folder: Path, quant: str, what: str | None = None) -> Path:
    """The export's GGUF file of type `quant` (export.gguf lists the types it writes); one
    line naming the types there are when it has none of that type."""
    types = gguf_types(folder)
    if quant.lower() in types:
        return types[quant.lower()]
    have = (f"its types: {', '.join(types)}" if types else
            "it has no GGUF files: list types in export.gguf and rerun the export stage")
    raise PipelineError(f"--gguf {quant}: {what or folder} has no GGUF file of that type "
                        f"({have})")


def _transformers_command(folder: Path, host: str, port: int) -> list[str]:
    exe = Path(sys.executable).parent / "transformers"
    if not exe.exists():
        found = shutil.which("transformers")
        if found is None:
            raise PipelineError("`transformers serve` is not installed: pip install "
                                "'transformers[serving]'")
        exe = Path(found)
    return [str(exe), "serve", str(folder), "--host", host, "--port", str(port),
            "--device", "cpu" if not _has_gpu() else "auto", "--log-level", "warning"]


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


#: the optional extra that installs llama.cpp's server (pyproject.toml) and its pin
GGUF_EXTRA, LLAMA_CPP_PIN = "serve-gguf", "llama-cpp-python[server]==0.3.36"


def check_llama_cpp(gguf: Path) -> None:
    """One line when llama-cpp-python's server cannot be imported: what to install."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise PipelineError(
            f"--gguf: serving {gguf.name} needs llama-cpp-python's server, which is not "
            f"installed: pip install -e '.[{GGUF_EXTRA}]' ({LLAMA_CPP_PIN}; it compiles "
            "llama.cpp, about 16 minutes on 2 cores)") from None
    try:
        import llama_cpp.server.app  # noqa: F401 - fastapi, uvicorn, sse-starlette, ...
    except ImportError as exc:
        raise PipelineError(
            f"--gguf: llama-cpp-python is installed without its server's packages "
            f"({exc.name or exc}): pip install -e '.[{GGUF_EXTRA}]' ({LLAMA_CPP_PIN})") from None


def _llama_command(gguf: Path, host: str, port: int) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server on the GGUF file: its context the model's
    (n_ctx 0), its chat format the file's chat template (tokenizer.chat_template), its own
    log quiet (the proxy prints where it answers)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--model_alias", gguf.name, "--host", host, "--port", str(port), "--n_ctx", "0",
            "--verbose", "False"]


def gguf_chat_template(gguf: Path) -> str | None:
    """The chat template in the GGUF file's metadata (the export writes the run's tokenizer's),
    which llama-cpp-python's server uses for /v1/chat/completions."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    except Exception as exc:  # the reader's own errors on a file that is cut or not GGUF
        raise PipelineError(f"--gguf: {gguf} is not a GGUF file llama.cpp can read "
                            f"({exc})") from None
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def sampling_defaults(folder: Path) -> dict:
    """The model's generation defaults (generation_config.json, transformers' own where it
    sets none) as llama-cpp-python's request fields, for a request that gives none of them:
    greedy (temperature 0) unless the model samples, no repetition penalty unless it sets one
    (llama-cpp-python's own defaults are temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
    repeat_penalty 1.1: not what transformers serve or the evaluate stage would do)."""
    import json

    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}

    def get(key, default):
        value = config.get(key)
        return default if value is None else value

    return {"temperature": float(get("temperature", 1.0)) if config.get("do_sample") else 0.0,
            "top_p": float(get("top_p", 1.0)), "top_k": int(get("top_k", 50)),
            "min_p": float(get("min_p", 0.0)),
            "repeat_penalty": float(get("repetition_penalty", 1.0))}


class _Quiet:
    """The engine's output passed on line by line, less uvicorn's INFO lines (both engines
    run uvicorn: its start-up lines name the engine's own port, not the one clients call, and
    it logs one line a request)."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.proc = proc
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("INFO:"):
                sys.stdout.write(line)
                sys.stdout.flush()


def _ready(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> None:
    """Wait until the server answers GET `path` (transformers serve's /health; llama-cpp-python's
    server has none, its /v1/models answers once the model is loaded); one line if it exits
    first or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PipelineError(f"the server exited with code {proc.returncode} before "
                                f"answering at {url} (its output is above)")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise PipelineError(f"the server did not answer at {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (as Ctrl-C), then SIGTERM, then SIGKILL, waiting a little for each."""
    for sig, wait in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


class Proxy:
    """The port clients call, in front of the engine's server (on a free port of its own): it
    passes every request through (streams as they come) and adds only what the engine lacks:
    `/v1/models` lists the one model served (transformers serve lists the Hub cache's), any
    request's `model` is the served one, and a chat completion asked with `tools`
    (streamed or not) gets the calls our parser (finetune.datatypes.tool_calls) reads in its text as
    `tool_calls` where the engine found none (transformers serve parses only the chat
    formats it knows), and a request without max_tokens gets the run's
    (eval.generation_max_new_tokens). `defaults` are request fields a completion or chat
    completion gets where it gives none (llama.cpp's: the model's sampling defaults)."""

    def __init__(self, host: str, port: int, backend: str, model_id: str, engine_id: str,
                 chat: bool = True, max_tokens: int | None = None,
                 defaults: dict | None = None):
        from http.server import ThreadingHTTPServer

        self.backend, self.model_id, self.engine_id = backend, model_id, engine_id
        self.chat, self.max_tokens, self.defaults = chat, max_tokens, defaults or {}
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True

    def start(self) -> None:
        import threading

        self.started = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if getattr(self, "started", False):
            self.server.shutdown()  # waits for serve_forever, which must have run
        self.server.server_close()

    def _handler(self):
        import json
        from http.server import BaseHTTPRequestHandler

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: bytes, headers) -> None:
                self.send_response(code)
                for key, value in headers:
                    if key.lower() not in ("content-length", "transfer-encoding", "connection",
                                           "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    body = json.dumps({"object": "list", "data": [
                        {"id": proxy.model_id, "object": "model", "created": 0,
                         "owned_by": "finetune"}]}).encode()
                    self._reply(200, body, [("Content-Type", "application/json")])
                    return
                self._forward(None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = None
                if self.path.startswith("/v1/chat/completions") and not proxy.chat:
                    message = (f"{proxy.model_id} has no chat template (its run trained on "
                               "prompts and completions): ask /v1/completions")
                    self._reply(400, json.dumps({"error": {"message": message}}).encode(),
                                [("Content-Type", "application/json")])
                    return
                if isinstance(body, dict):
                    body["model"] = proxy.engine_id
                    # the run's default length (transformers serve's own is 1024 tokens)
                    if (proxy.max_tokens and body.get("max_tokens") is None
                            and body.get("max_completion_tokens") is None):
                        body["max_tokens"] = proxy.max_tokens
                    if self.path.startswith(("/v1/completions", "/v1/chat/completions")):
                        for key, value in proxy.defaults.items():
                            if body.get(key) is None:
                                body[key] = value
                self._forward(body if isinstance(body, dict) else raw)

            def _forward(self, body) -> None:
                data = json.dumps(body).encode() if isinstance(body, dict) else body
                request = urllib.request.Request(
                    proxy.backend + self.path, data=data, method=self.command,
                    headers={k: v for k, v in self.headers.items()
                             if k.lower() not in ("host", "content-length")})
                try:
                    resp = urllib.request.urlopen(request, timeout=3600)
                except urllib.error.HTTPError as err:
                    resp = err
                except OSError as exc:
                    self._reply(502, json.dumps({"error": str(exc)}).encode(),
                                [("Content-Type", "application/json")])
                    return
                with resp:
                    kind = resp.headers.get("Content-Type", "")
                    if "text/event-stream" in kind:  # a stream: each piece as it comes
                        self.send_response(resp.status)
                        self.send_header("Content-Type", kind)
                        self.send_header("Connection", "close")
                        self.end_headers()
                        events = ToolCallStream() if (
                            isinstance(body, dict) and body.get("tools")
                            and self.path.startswith("/v1/chat/completions")) else None
                        while piece := resp.read1(65536):
                            self.wfile.write(events.feed(piece) if events else piece)
                            self.wfile.flush()
                        return
                    out = resp.read()
                    if resp.status == 200 and "json" in kind and isinstance(body, dict):
                        reply = json.loads(out)
                        if isinstance(reply, dict) and "model" in reply:
                            reply["model"] = proxy.model_id
                        if body.get("tools") and self.path.startswith("/v1/chat/completions"):
                            reply = with_tool_calls(reply)
                        out = json.dumps(reply).encode()
                    self._reply(resp.status, out, resp.headers.items())

        return Handler


class ToolCallStream:
    """A streamed chat completion (server-sent events) passed on event by event, its content
    deltas read as they go: the event that ends a choice (its finish_reason) is preceded by
    one delta with the `tool_calls` our parser reads in the choice's whole text, and ends
    with finish_reason tool_calls, when there are calls and the engine streamed none."""

    def __init__(self):
        self.pending = b""
        self.text: dict[int, str] = {}
        self.engine_calls: set[int] = set()

    def feed(self, piece: bytes) -> bytes:
        self.pending += piece
        *events, self.pending = self.pending.split(b"\n\n")
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def _event(self, event: bytes) -> bytes:
        import json

        from finetune.datatypes.tool_calls import parse_tool_calls

        if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
            return event
        try:
            chunk = json.loads(event[len(b"data: "):])
        except json.JSONDecodeError:
            return event
        extra = []
        for choice in chunk.get("choices", []):
            delta, i = choice.get("delta") or {}, choice.get("index", 0)
            if delta.get("tool_calls"):
                self.engine_calls.add(i)
            self.text[i] = self.text.get(i, "") + (delta.get("content") or "")
            if not choice.get("finish_reason") or i in self.engine_calls:
                continue
            calls = parse_tool_calls(self.text[i])
            if calls:
                extra.append({**chunk, "choices": [{"index": i, "finish_reason": None, "delta": {
                    "tool_calls": [{"index": n, "id": f"call_{n}", "type": "function",
                                    "function": {"name": c["name"],
                                                 "arguments": json.dumps(c["arguments"])}}
                                   for n, c in enumerate(calls)]}}]})
                choice["finish_reason"] = "tool_calls"
        if not extra:
            return event
        return b"\n\n".join([*(b"data: " + json.dumps(e).encode() for e in extra),
                              b"data: " + json.dumps(chunk).encode()])


def with_tool_calls(reply: dict) -> dict:
    """A chat completion with the calls finetune.datatypes.tool_calls reads in each choice's
    text as OpenAI `tool_calls` (finish_reason tool_calls), where it has none."""
    import json

    from finetune.datatypes.tool_calls import parse_tool_calls

    for choice in reply.get("choices", []):
        message = choice.get("message") or {}
        if message.get("tool_calls") or not message.get("content"):
            continue
        calls = parse_tool_calls(message["content"])
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for i, c in enumerate(calls)]
            choice["finish_reason"] = "tool_calls"
    return reply


def has_chat_template(folder: Path) -> bool:
    """Whether the folder's tokenizer has a chat template (the run's: a chat dataset's, which
    the train stage saves and the export keeps; a completion run's tokenizer has none)."""
    import json

    if (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists():
        return True
    config = folder / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve(ws: Workspace, target: str | None, port: int = 8000, gguf: str | None = None,
          host: str = "127.0.0.1", ready_timeout: float = 600) -> int:
    """Check, start the engine and the proxy, print where it answers, and wait until it is
    stopped (Ctrl-C, SIGTERM: 0)."""
    folder, source, name, max_tokens = _resolved(ws, target)
    gguf_path = gguf_file(folder, gguf, target or default_model(ws)) if gguf else None
    need = check_fits(folder, gguf_path)
    inner = _free_port(host)
    if gguf_path is not None:
        check_llama_cpp(gguf_path)
        command, engine_id = _llama_command(gguf_path, host, inner), gguf_path.name
        chat, defaults, health = gguf_chat_template(gguf_path) is not None, \
            sampling_defaults(folder), "/v1/models"
    else:
        command, engine_id = _transformers_command(folder, host, inner), str(folder)
        chat, defaults, health = has_chat_template(folder), None, "/health"
    url, backend = f"http://{host}:{port}", f"http://{host}:{inner}"
    # the port is bound now (the check), served once the engine answers
    check_port(host, port)
    try:
        proxy = Proxy(host, port, backend, name, engine_id, chat, max_tokens, defaults)
    except OSError as exc:
        raise PipelineError(f"--port {port}: {host}:{port} is in use ({exc.strerror}); "
                            "choose another with --port") from None
    engine = (f"llama.cpp's server (python -m llama_cpp.server) on {gguf_path.name}"
              if gguf_path is not None else f"{Path(command[0]).name} {command[1]}")
    print(f"[serve] {source}: {need / 2**20:.1f} MiB of weights; starting {engine}",
          flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        proc = subprocess.Popen(command, env=env, cwd=ws.root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
    except BaseException:
        proxy.stop()
        raise
    quiet = _Quiet(proc)
    try:
        _ready(backend, proc, ready_timeout, health)
        proxy.start()
        print(f"[serve] OpenAI-compatible server at {url}/v1 (model '{name}'); "
              + ("/v1/chat/completions uses the run's chat template; " if chat else
                 "no chat template (a completion run): /v1/completions only; ")
              + ("the model's generation defaults where a request gives none; "
                 if gguf_path is not None else "")
              + "Ctrl-C stops it", flush=True)
        print(f"curl {url}/v1/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{name}\", \"prompt\": \"Question: 2 + 3?\\nAnswer:\", "
              f"\"max_tokens\": {max_tokens}, \"temperature\": 0}}'", flush=True)
        code = proc.wait()
        raise PipelineError(f"the server exited with code {code} (its output is above)")
    except KeyboardInterrupt:
        _stop(proc)
        quiet.thread.join(5)  # the engine's last lines before ours
        print(f"[serve] stopped the server at {url}", flush=True)
        return 0
    finally:
        proxy.stop()
        if proc.poll() is None:
            _stop(proc)
