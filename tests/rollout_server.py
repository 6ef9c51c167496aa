"""A small OpenAI-compatible completions server for the tests: vLLM's HTTP surface that
engine/rollout/vllm_server.py speaks, over our own LocalGenerator, so the vLLM path runs over
real HTTP on 127.0.0.1 without a GPU or vLLM. Tests only: the pipeline ships no server.

Endpoints, with vLLM's names and shapes:
- GET /v1/models: the served base model and the adapters loaded;
- POST /v1/completions: `prompt` as token ids (one list, or a list of lists), `n`, `seed`,
  temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, `logprobs` (the sampled
  token's log-probability), `return_token_ids`, `return_tokens_as_token_ids`; the choices of a
  prompt come in order, each with `token_ids` (up to and including EOS), `logprobs` with
  `tokens` as "token_id:<id>" strings and `token_logprobs`, and `finish_reason`. A request's
  completions are `LocalGenerator.generate(prompt, n, [seed])`: what the training process
  draws for that prompt with that seed (one seed per prompt). The log-probabilities are the
  model's own forward over prompt + completion at the request's temperature (vLLM's
  `--logprobs-mode processed_logprobs` without the top-k/top-p filtering), so they differ from
  the training forward's only by float rounding (the generation folds LoRA adapters);
- POST /v1/load_lora_adapter {lora_name, lora_path}: a peft adapter folder loaded onto a copy
  of the base model, selectable by `model`; /v1/unload_lora_adapter {lora_name}. With
  `runtime_lora=False` both answer 404, as vLLM does without
  VLLM_ALLOW_RUNTIME_LORA_UPDATING.

Requests are served on threads, the model calls one at a time (a lock: generation folds
adapters into the weights in place).
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch


class RolloutServer:
    """`with RolloutServer(model_dir) as server:` serves at `server.url` (a free port)."""

    def __init__(self, model_dir: Path, *, runtime_lora: bool = True,
                 served_name: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engine.rollout.local import eos_ids

        self.base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.base.eval()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos = eos_ids(tok, self.base)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.name = served_name or str(model_dir)
        self.runtime_lora = runtime_lora
        self.adapters: dict[str, torch.nn.Module] = {}
        self.lock = threading.Lock()
        #: every /v1/completions payload received, and every adapter name loaded
        self.requests: list[dict] = []
        self.loaded: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "RolloutServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    # -- what the endpoints do -----------------------------------------------------------
    def models(self) -> dict:
        ids = [self.name, *self.adapters]
        return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}

    def load(self, body: dict) -> tuple[int, dict | str]:
        from peft import PeftModel

        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, {"error": {"message": "lora_name and lora_path are required"}}
        if name in self.adapters:
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been "
                                              "loaded."}}
        with self.lock:
            model = PeftModel.from_pretrained(copy.deepcopy(self.base), str(path))
            model.eval()
            self.adapters[name] = model
        self.loaded.append(name)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> tuple[int, dict | str]:
        name = body.get("lora_name")
        if name not in self.adapters:
            return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
        del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def complete(self, body: dict) -> tuple[int, dict]:
        from engine.recipe.grpo.loss import completion_logps
        from engine.rollout.local import LocalGenerator
        from engine.rollout.sampling import SamplingParams

        self.requests.append(body)
        model_name = body.get("model") or self.name
        model = self.base if model_name == self.name else self.adapters.get(model_name)
        if model is None:
            return 404, {"error": {"message": f"The model `{model_name}` does not exist."}}
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, list) and p for p in prompts):
            return 400, {"error": {"message": "prompt must be token ids"}}
        n = int(body.get("n", 1))
        temperature = float(body.get("temperature", 1.0))
        top_k = int(body.get("top_k") or 0)
        params = SamplingParams(max_completion_length=int(body.get("max_tokens", 16)),
                                temperature=temperature, top_p=float(body.get("top_p", 1.0)),
                                top_k=max(top_k, 0), min_p=body.get("min_p") or None,
                                repetition_penalty=float(body.get("repetition_penalty", 1.0)))
        seed = body.get("seed")
        choices = []
        with self.lock:
            for prompt in prompts:
                ids = torch.tensor([prompt], dtype=torch.long)
                mask = torch.ones_like(ids)
                draws = [int(seed)] if seed is not None else [int(torch.seed() % 2**62)]
                done = LocalGenerator(model, params, self.eos, self.pad).generate(
                    ids, mask, n, draws)
                width = done.ids.shape[1]
                full = torch.cat([ids.repeat(n, 1), done.ids], dim=1)
                attention = torch.cat([mask.repeat(n, 1), done.mask], dim=1)
                with torch.no_grad():
                    logps = completion_logps(model, full, attention, width,
                                             temperature if temperature > 0 else 1.0)[0]
                for row in range(n):
                    length = int(done.lengths[row])
                    tokens = done.ids[row, :length].tolist()
                    values = logps[row, :length].tolist()
                    choice = {"index": row, "text": "",
                              "finish_reason": "length" if bool(done.clipped[row]) else "stop",
                              "prompt_token_ids": prompt if body.get("return_token_ids")
                              else None}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = tokens
                    if body.get("logprobs") is not None:
                        as_ids = body.get("return_tokens_as_token_ids")
                        choice["logprobs"] = {
                            "tokens": [f"token_id:{t}" if as_ids else str(t) for t in tokens],
                            "token_logprobs": values, "top_logprobs": [None] * length,
                            "text_offset": [0] * length}
                    choices.append(choice)
        return 200, {"id": "cmpl-test", "object": "text_completion", "model": model_name,
                     "choices": choices}

    # -- HTTP ----------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(
                    body, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, server.models())
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                routes = {"/v1/completions": server.complete}
                if server.runtime_lora:
                    routes.update({"/v1/load_lora_adapter": server.load,
                                   "/v1/unload_lora_adapter": server.unload})
                if self.path not in routes:
                    self._send(404, {"detail": "Not Found"})
                    return
                try:
                    self._send(*routes[self.path](body))
                except Exception as error:  # the test reads the server's error as vLLM's
                    self._send(500, {"error": {"message": f"{type(error).__name__}: {error}"}})

        return Handler
