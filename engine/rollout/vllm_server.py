"""Completions from a vLLM server (`use_vllm`, `vllm_mode: server`): a `Generator` over an
OpenAI-compatible `vllm serve MODEL --enable-lora` process, and the adapter pushed to it.

`VLLMServerGenerator.generate` sends one `/v1/completions` request per prompt: the prompt as
token ids (its real tokens, the left padding dropped), `n` = num_generations, that prompt's
`seed`, the section's temperature, top_p, top_k, min_p, repetition_penalty and
max_completion_length (`max_tokens`), `logprobs: 0` (the sampled token's log-probability only)
and `return_token_ids` / `return_tokens_as_token_ids`, so the completions come back as ids,
not text. One request per prompt, each with its own seed, is what keeps a prompt's completions
independent of the other prompts of the call and of how ranks split the step (the same
guarantee as `LocalGenerator`'s per-prompt seeds); the requests of a call run concurrently.
The answer is made into `Completions` with the seam's conventions (rows of prompt 0 first, the
mask up to and including the first EOS, no EOS within max_completion_length: clipped) plus
`sampling_logps`, the server's log-probability of each sampled token ([N, T], 0 after the end;
NaN where the server gave none), which the importance-sampling correction compares with the
training forward's (engine.recipe.grpo.loss.sampling_correction).

The policy reaches the server as a LoRA adapter: `load_adapter` POSTs vLLM's runtime LoRA API
(`/v1/load_lora_adapter` with `lora_name` and `lora_path`, which needs the server started with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), after which requests name the adapter as their
`model`; each version gets a new name (vLLM caches an adapter by name) and the previous one is
unloaded (`/v1/unload_lora_adapter`). The folder must be on a filesystem the server reads.

Log-probabilities: vLLM returns those of the raw model output unless started with
`--logprobs-mode processed_logprobs` (TRL's advice), which makes them the tempered (and
filtered) distribution's that the run's forward computes; with raw ones and a temperature other
than 1 the correction sees a mismatch that is the server's setting, not its numerics.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.rollout.generator import Completions, check_request
from engine.rollout.sampling import SamplingParams
from finetune.errors import PipelineError

#: how many requests of one call are in flight at once (vLLM batches what it receives)
CONCURRENT_REQUESTS = 32
#: the name prefix of the adapters this run loads (`<prefix>-<version>`)
ADAPTER_PREFIX = "policy"


def _post(url: str, payload: dict, timeout: float | None) -> tuple[int, str]:
    """(status, body) of a JSON POST; an HTTP error's status and body too."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def served_models(base_url: str, key: str, timeout: float, poll: float = 0.5) -> list[str]:
    """The model ids `GET /v1/models` lists, asked until the server answers or `timeout`
    seconds passed (TRL's vllm_server_timeout: the wait for the server to be up); a server
    that never answers is one line naming `key` and the URL."""
    deadline = time.monotonic() + timeout
    reason = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models",
                                        timeout=max(min(left, 10.0), 0.1)) as answer:
                data = json.loads(answer.read().decode())
            models = [m["id"] for m in data.get("data", [])]
            if not models:
                raise PipelineError(f"{key} {base_url}: the server lists no model at /v1/models")
            return models
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = str(getattr(error, "reason", error)) or type(error).__name__
        if time.monotonic() + poll >= deadline:
            break
        time.sleep(poll)
    raise PipelineError(
        f"{key} {base_url}: no vLLM server answered /v1/models within {timeout:g} s "
        f"({reason}); start `vllm serve MODEL --enable-lora` there (with "
        f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or fix the URL")


class VLLMServerGenerator:
    """A `Generator` (engine.rollout.generator) over a vLLM server: see the module docstring.

    `model`: the served model's id to ask before any adapter is loaded (None: the first
    `/v1/models` lists). `key`: the config key that names the URL, for the messages.
    """

    def __init__(self, base_url: str, params: SamplingParams, eos_token_ids: list[int],
                 pad_token_id: int, *, key: str = "grpo.vllm_server_base_url",
                 timeout: float = 240.0, model: str | None = None,
                 concurrent: int = CONCURRENT_REQUESTS):
        self.base_url = base_url.rstrip("/")
        self.params = params
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.key = key
        self.timeout = timeout
        self.concurrent = concurrent
        self.base_model = model or served_models(self.base_url, key, timeout)[0]
        #: what requests name as their `model`: the base, then the last adapter loaded
        self.model = self.base_model

    # -- the adapter -------------------------------------------------------------------------
    def load_adapter(self, name: str, path) -> None:
        """Registers the peft adapter folder `path` under `name` on the server and makes it
        the model requests ask for; unloads the adapter loaded before it."""
        status, body = self._call("/v1/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(path)})
        if status == 404:
            raise PipelineError(
                f"{self.key} {self.base_url}: the server has no /v1/load_lora_adapter; start "
                "it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (its "
                "--max-lora-rank at least peft.r)")
        if status != 200:
            raise PipelineError(f"{self.key} {self.base_url}: loading the adapter {path} as "
                                f"'{name}' failed ({status}: {_one_line(body)})")
        previous, self.model = self.model, name
        if previous != self.base_model:
            self._call("/v1/unload_lora_adapter", {"lora_name": previous})

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int]) -> Completions:
        check_request(prompt_ids, prompt_mask, num_generations)
        count = prompt_ids.shape[0]
        if isinstance(seed, Sequence):
            if len(seed) != count:
                raise ValueError(f"{len(seed)} seeds for {count} prompts: give one seed, or "
                                 "one per prompt")
            seeds = [int(s) for s in seed]
        else:  # one seed for the call: prompt i gets seed + i (each request needs its own)
            seeds = [int(seed) + i for i in range(count)]
        prompts = [[t for t, m in zip(ids, mask) if m]
                   for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrent, count))) as pool:
            answers = list(pool.map(lambda i: self._complete(prompts[i], num_generations,
                                                             seeds[i]), range(count)))
        rows = [row for answer in answers for row in answer]
        return self._completions(rows, prompt_ids.device)

    def _complete(self, prompt: list[int], n: int, seed: int) -> list[tuple[list, list]]:
        """One prompt's n completions: [(token ids, their log-probabilities)], in the
        server's choice order."""
        p = self.params
        payload = {"model": self.model, "prompt": prompt, "n": n, "seed": seed,
                   "max_tokens": p.max_completion_length, "temperature": p.temperature,
                   "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p or 0.0,
                   "repetition_penalty": p.repetition_penalty, "logprobs": 0,
                   "return_token_ids": True, "return_tokens_as_token_ids": True,
                   "skip_special_tokens": False}
        status, body = self._call("/v1/completions", payload)
        if status != 200:
            raise PipelineError(f"{self.key} {self.base_url}: /v1/completions answered "
                                f"{status}: {_one_line(body)}")
        choices = sorted(json.loads(body)["choices"], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise PipelineError(f"{self.key} {self.base_url}: /v1/completions returned "
                                f"{len(choices)} completions for n={n}")
        return [_ids_and_logps(choice) for choice in choices]

    def _call(self, path: str, payload: dict) -> tuple[int, str]:
        try:
            return _post(f"{self.base_url}{path}", payload, None)
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise PipelineError(f"{self.key} {self.base_url}: {path} failed ({reason}); is "
                                "the vLLM server still running?") from None

    def _completions(self, rows: list[tuple[list, list]], device) -> Completions:
        """Server rows -> Completions: cut after the first EOS (kept), right-padded."""
        eos = set(self.eos_token_ids)
        cut = []
        for ids, values in rows:
            ids = ids[:self.params.max_completion_length]
            end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
            cut.append((ids[:end], values[:end], end < len(ids) or (
                bool(ids) and ids[end - 1] in eos)))
        width = max(1, max(len(ids) for ids, _, _ in cut))
        n = len(cut)
        out = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        logps = torch.zeros((n, width), dtype=torch.float32)
        for row, (ids, lp, _) in enumerate(cut):
            if ids:
                out[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                mask[row, :len(ids)] = 1
                logps[row, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        finished = torch.tensor([ended for _, _, ended in cut], dtype=torch.bool)
        return Completions(ids=out.to(device), mask=mask.to(device),
                           lengths=mask.sum(1).to(device), clipped=(~finished).to(device),
                           sampling_logps=logps.to(device))


def _ids_and_logps(choice: dict) -> tuple[list[int], list[float]]:
    """A choice's sampled token ids and their log-probabilities (NaN where the server gave
    none): the ids from `token_ids` (return_token_ids), else from the logprobs' tokens,
    `token_id:<id>` strings (return_tokens_as_token_ids)."""
    logprobs = choice.get("logprobs") or {}
    values = [math.nan if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    ids = choice.get("token_ids")
    if ids is None:
        tokens = logprobs.get("tokens")
        if tokens is None:
            raise PipelineError("a /v1/completions choice has neither token_ids nor logprobs "
                                "tokens: the server is not vLLM's OpenAI server (or too old "
                                "for return_token_ids / return_tokens_as_token_ids)")
        ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
    ids = [int(t) for t in ids]
    if len(values) < len(ids):
        values += [math.nan] * (len(ids) - len(values))
    return ids, values[:len(ids)]


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
