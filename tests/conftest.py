"""Shared fixtures: an isolated copy of the project (its own git repo, DVC, MLflow store), the
session's tokenized project, the offline environment; and the order test files run in.

The plain helpers these build on, and that test files import, are in tests/helpers.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import BIN, copy_project, stages_here

#: The longest work units first (by `--durations` on the 2-core dev CPU): a file, or one test
#: class of a file (`file::Class`, the docs lanes). `make test`, `make test-slow` and `make
#: test-slow-docs` hand whole units to the pytest-xdist workers in this order (--dist loadfile
#: or loadscope, --no-loadscope-reorder), so no long unit starts last and runs alone at the
#: end. One list for every tier: a unit with no test in a tier is simply not there. In the
#: session of .ci/run's last step (test-slow-docs: `make test-slow` and `make test-docs` in
#: one session) the README's lane goes first and docs/'s after test_pipeline.py: the docs
#: lane's DPO and GRPO examples start from the README's `make run`, which by then DVC's
#: run-cache restores instead of the docs lane waiting for it (tests/test_docs.py WAITS_FOR).
LONGEST_FIRST = ("test_docs.py::TestReadmeLane", "test_pipeline.py", "test_docs.py::TestDocsLane",
                 "test_strategies.py", "test_slurm.py", "test_e2e_prefect.py",
                 "test_reproduce.py", "test_training.py", "test_reward.py", "test_preference.py",
                 "test_pipeline_parallel.py", "test_reliability.py", "test_kto.py",
                 "test_publish.py", "test_grpo.py", "test_failures.py", "test_flows.py",
                 "test_distill.py", "test_distill_trl.py",
                 "test_harness.py", "test_launch.py", "test_quantization.py",
                 "test_run_control.py", "test_streaming.py", "test_methods.py",
                 "test_grpo_generation.py", "test_loss.py", "test_adapter_options.py",
                 "test_cli.py", "test_mixture.py")


#: The same for the slow tier's session (`make test-slow`, `make test-slow-docs`, `-m
#: distributed`...: a mark expression that selects a slow marker): its units by their time in
#: .ci/run's test-slow-docs on the 2-core dev CPU, ending with the shortest, so the worker that
#: finishes first waits at most one short unit for the other. The docs lanes keep their
#: places (the README's first; docs/'s after test_pipeline.py, see above).
SLOW_LONGEST_FIRST = (
    "test_docs.py::TestReadmeLane",  # ~560 s
    "test_pipeline.py",  # ~280 s
    "test_docs.py::TestDocsLane",  # ~820 s, after the README's `make run` (WAITS_FOR)
    "test_strategies.py",  # ~300 s
    "test_slurm.py",  # ~280 s
    "test_reproduce.py",  # ~180 s
    "test_e2e_prefect.py",  # ~170 s
    "test_preference.py",  # ~145 s
    "test_pipeline_parallel.py",  # ~140 s
    "test_in_training_metrics.py",  # ~110-150 s at load 6 (tools example, DDP/FSDP2)
    "test_failures.py",  # ~95 s
    "test_serve.py",  # ~60-90 s at load 6 (trains a fixture, starts transformers serve)
    "test_kto.py",  # ~90 s
    "test_adapter_options.py",  # ~65 s
    "test_reward.py",  # ~60 s
    "test_cli.py",  # ~40-60 s
    "test_preemption.py",  # ~30-50 s
    "test_grpo.py",  # ~40 s
    "test_distill.py",  # ~35 s at load 6 (on-policy resume)
    "test_streaming.py",  # ~35 s
    "test_grpo_environments.py",  # ~30 s
    "test_launch.py",  # ~25 s
    "test_vision.py",  # ~20 s
    "test_seq2seq.py",  # ~18 s
)
#: the markers only the slow tier selects (pyproject.toml's addopts deselects them)
SLOW_MARKERS = ("slow", "distributed", "clean_room", "stack_e2e", "slurm", "docs_commands")


def _slow_tier(config) -> bool:
    """Whether the session's mark expression selects a slow marker (`make test`'s is the
    addopts' `not ... and not ...`, which selects none)."""
    expr = config.getoption("markexpr", "") or ""
    return "not " not in expr and any(m in expr.split() for m in SLOW_MARKERS)


def _unit_rank(item, order: tuple[str, ...] = LONGEST_FIRST) -> int:
    """The place of the item's unit in `order` (its class's entry before its file's)."""
    rank = {name: i for i, name in enumerate(order)}
    names = [item.path.name]
    if getattr(item, "cls", None) is not None:
        names.insert(0, f"{item.path.name}::{item.cls.__name__}")
    return min((rank[n] for n in names if n in rank), default=len(order))


def pytest_collection_modifyitems(config, items):
    """Reorder whole units only (a stable sort keeps each unit's own order)."""
    order = SLOW_LONGEST_FIRST if _slow_tier(config) else LONGEST_FIRST
    items.sort(key=lambda item: _unit_rank(item, order))


#: what libraries read once, when first imported: set here, as this file is imported, since
#: test modules import transformers and datasets at collection, before any fixture runs (a
#: bare `pytest` without the Makefile's exports otherwise ran them online: every refused hub
#: id waited ~23 s on the network before its HF_HUB_OFFLINE error, four such tests per run)
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(OFFLINE)


@pytest.fixture(autouse=True, scope="session")
def _offline_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("caches")
    env = {
        **OFFLINE,
        "HF_HOME": str(cache / "hf"),
        "DVC_SITE_CACHE_DIR": str(cache / "dvc-site"),
        "FINETUNE_CACHE_DIR": str(cache / "finetune"),
        "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        # test files run side by side on the cores: an OpenMP thread that spins while it
        # waits holds the core another test's thread needs (two 2-thread trainings side by
        # side took 3.1x as long as with passive waits: 192 vs 62 s); the same numbers either way
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def project(tmp_path) -> Path:
    return copy_project(tmp_path / "proj")


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory) -> Path:
    """A project with download/format/tokenize and the teacher stage (for a run that is not a
    distill run: its teacher.json alone, which train depends on in dvc.yaml) done once per test
    process (in-process: no process boundary is under test there); tests copy it and train."""
    project = copy_project(tmp_path_factory.mktemp("tok") / "p", {"logging.logging_steps": 1})
    stages_here(project, "download", "format", "tokenize", "teacher")
    return project


#: Chat-template markers: the special ones never split and are dropped by skip_special_tokens;
#: the added ones never split either but decode as text, as in Qwen's and Llama's tokenizers.
CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHAT_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
              "</think>")


@pytest.fixture(scope="session")
def bpe_tok():
    return chat_bpe_tokenizer()


def chat_bpe_tokenizer():
    """A byte-level BPE tokenizer trained here in well under a second on a little English,
    JSON and digits (about 700 tokens: the corpus runs out of merges before the 1000 asked
    for), wrapped as a fast transformers tokenizer with the chat markers of ChatML and Llama 3
    as atomic tokens: the chat-template tests need real multi-byte merges and offsets without
    a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The weather in Paris is sunny and the temperature is 21 degrees today.",
        "You are a helpful assistant. Answer the question, then stop.",
        "What is the capital of France? The capital of France is Paris.",
        "Please look up the order number and tell me when it will arrive.",
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        '{"type": "function", "function": {"name": "add", "description": "Add two numbers", '
        '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}',
        "0123456789 12 345 6789 3.14 2024 100 42 7 1e3 -5",
        "Let me think step by step: first add the numbers, then check the result.",
        "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython",
        "system user assistant tool ipython function arguments parameters properties required",
        "Given the following functions, please respond with a JSON for a function call.",
        "You may call one or more functions to assist with the user query.",
        "For each function call, return a json object with function name and arguments.",
        "She said that they would meet at the station before noon, and nobody was late.",
        "A small model learns quickly when the data is clean and the steps are short.",
        "How many people live in Tokyo? About 14 million people live in the city of Tokyo.",
        '[{"id": 1, "ok": true, "items": [3, 5, 8], "price": 9.99, "note": null}]',
        "The result of 17 + 25 is 42, and 6 * 7 is also 42; 100 - 58 = 42.",
    ] * 4
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=list(CHAT_SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL)})
    tok.add_tokens(list(CHAT_ADDED))
    return tok
