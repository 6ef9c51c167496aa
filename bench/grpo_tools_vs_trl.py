"""One multi-turn GRPO optimizer step with tools in the loop: ours (`grpo.tools`,
engine.recipe.grpo.run.GRPORun around engine.rollout.multi_turn.ToolLoop) against TRL 1.16's
`GRPOTrainer(tools=[...])` (transformers generation, no vLLM), the same model, prompts, tool,
reward function and settings. A completion is an episode: generate, parse a tool call, run it,
append the tool message, continue, until a turn makes no call, max_tool_calling_iterations, or
max_completion_length tokens for the whole episode.

The model is the calculator agent's SFT model (`make sft-agent`: stories260K fine-tuned on
params/agent-sft-gsm8k.yaml to write calls), its tokenizer's chat template
params/templates/calculator-chat.jinja: an assistant turn is its text, then
`Call: {"name": "calculator", "arguments": {"expression": "48/2"}}`, then EOS; a tool result
is a `Result: 24` line; the generation prompt is `Assistant: `. The prompts are the first rows
of data/source/gsm8k-agent/train.jsonl (conversational: `Compute 12+4.`), each side seeing
each once; the tool is `calculator` below (preprocess/calculator_env.py's `evaluate`, with the
docstring of its `Calculator.calculator`, so its schema is data/source/gsm8k-tools/tools.json).

Settings, both sides: LoRA r=16 alpha 32 all-linear (peft), fp32, 8 prompts per step x
num_generations 4 (our per_device_train_batch_size 8 counts prompts; TRL's 32 counts
completions), gradient_accumulation_steps 1, temperature 1.0, top_p 1, top_k 0,
max_completion_length 160, max_tool_calling_iterations 2, loss_type dapo, beta 0, fused AdamW,
lr 5e-4 constant, max_grad_norm 1, seed 42, one logged row per step, no checkpoints, no
evaluation. The reward is `reward` below (1 when the episode's text writes `#### <the row's
answer>`), the same function on both sides.

How each side reads a call: ours with its template-free parser (finetune.datatypes.tool_calls:
any JSON object with a name and arguments); TRL with the tokenizer's `response_template`
(transformers' parse_response), which TRL has none of for this template, so the worker sets
RESPONSE_TEMPLATE below and checks first that TRL reads a rendered call (`--check` also samples
a few completions from the model and prints what each parser reads in them). The parsers may
still differ on a malformed call: `calls` (tool calls per completion, TRL's
tools/call_frequency, both sides) says whether the sides ran about the same episodes.

Each side runs in its own fresh process (the same interpreter, torch threads = cores) and
times every step's wall, boundary to boundary, and inside it:
- generation: every turn's generation: ours the ToolLoop's inner LocalGenerator.generate,
  TRL's `_generate_single_turn` (first turn and the tool loop's);
- tools: the episode's host work besides generation (parse the calls, run them, render and
  encode the results): ours ToolLoop.generate minus generation; TRL's `_generate` minus
  `_tokenize_prompts` and generation (the first turn's parse_response, `_tool_call_loop`);
  `tool_run` is the tool calls alone inside it (ours ToolRunner._run, TRL its tool function);
- scoring: the rest of the rollout (ours `GRPORun.rollout`, TRL
  `_generate_and_score_completions`): decode, reward, advantages; TRL's prompt rendering and
  tokenization (ours is the tokenize stage's, before training);
- training: the step minus the rollout (forward, loss, backward, optimizer, logging).
The first `--warmup` steps are dropped; a run's numbers are medians over the others; rounds
alternate TRL then ours, each after waiting for a quiet machine, as bench/grpo_vs_trl.py does
(its Clock and machine checks are imported from it); the table gives each side's round with
the lowest median step.

Ours is driven in-process without the stage machinery: the rows are formatted and tokenized
with the product's own format and tokenize code (tasks.format.format_split with the method's
tool schemas, tasks.format.method_tool_schemas, then the `prompt` type's encoder), then
`GRPORun(cfg, paths, dist).fit()`.

    python bench/grpo_tools_vs_trl.py --check                # TRL reads the calls? no timing
    python bench/grpo_tools_vs_trl.py --steps 4 --warmup 1 --rounds 1
    python bench/grpo_tools_vs_trl.py --model-dir path/to/sft-model --steps 8 --rounds 2

Prints a markdown table and writes bench/results/grpo-tools-vs-trl-stories260K-agent-cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from grpo_vs_trl import LR, SEED, Clock, load_tokenizer, loadavg, wait_for_quiet  # noqa: E402
from preprocess.calculator_env import evaluate  # noqa: E402

MODEL_DIR = Path("/tmp/agentcheck/data/sft/gsm8k-agent")
TEMPLATE_FILE = ROOT / "params/templates/calculator-chat.jinja"
PROMPTS = ROOT / "data/source/gsm8k-agent/train.jsonl"
PROMPTS_PER_STEP = 8
GENERATIONS = 4
MAX_LENGTH = 160
MAX_ITERATIONS = 2
MAX_PROMPT = 320  # + MAX_LENGTH within the model's 512 positions
PARTS = ("generation", "tools", "tool_run", "scoring", "training")
RESULT = "grpo-tools-vs-trl-stories260K-agent"

#: how TRL (transformers' parse_response) reads an assistant turn of calculator-chat.jinja:
#: text, then `Call: {"name": ..., "arguments": {...}}` (one or more), then EOS. The call's
#: body is its arguments object: it closes at the `}` right after the arguments' own `}` (the
#: call object's), so the EOS need not follow (a turn cut at max_completion_length); a body
#: that is not JSON stays text (TRL then counts the call as failed instead of raising)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "Assistant: ",
    "fields": {
        "tool_calls": {
            "open_pattern": r'Call:\s*\{"name":\s*"(?P<name>[^"]+)",\s*"arguments":\s*',
            "close_pattern": r"(?<=\})\s*\}",
            "repeats": True,
            "content": "json",
            "content_args": {"allow_non_json": True},
            "transform": {"type": "function",
                          "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * /, parentheses).

    Args:
        expression: e.g. 48/2 or (3+4)*2
    """
    return evaluate(expression)


def reward(completions, answer, **kwargs):
    """1.0 when the episode's text writes `#### ` and the row's answer number (GSM8K's
    `#### 16`), else 0.0; a conversation's completion is read as all its messages' text."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else "\n".join(str(m.get("content") or "") for m in c)
        want = str(a).split("####")[-1].strip().replace(",", "")
        found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
        out.append(1.0 if any(f.replace(",", "") == want for f in found) else 0.0)
    return out


# -- shared inputs ---------------------------------------------------------------------------

def prompt_rows(n: int) -> list[dict]:
    """The first `n` rows of the agent's train split: {prompt: [user message], answer}."""
    rows = []
    with open(PROMPTS) as fh:
        for line in fh:
            rows.append(json.loads(line))
            if len(rows) == n:
                return rows
    raise SystemExit(f"{PROMPTS}: {len(rows)} rows; asked {n}")


def agent_tokenizer(model_dir: Path):
    """The model's tokenizer, with TRL's response template set (our side ignores it)."""
    tok = load_tokenizer(model_dir)
    tok.model_max_length = int(1e9)  # as the format stage's (tasks.format.data_context)
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def check_trl_reads_calls(tok) -> dict:
    """TRL's parser on a rendered call: a prompt as TRL renders it (the tools' schemas),
    then an assistant turn with one call, as the template renders it, in token ids."""
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": "48/2"}}}
    prompt = [{"role": "user", "content": "Compute 48/2."}]
    prompt_ids = tok.apply_chat_template(prompt, tools=[calculator], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    full = tok.apply_chat_template(
        prompt + [{"role": "assistant", "content": "", "tool_calls": [call]}],
        tools=[calculator], tokenize=True, return_dict=False)
    if list(full[:len(prompt_ids)]) != list(prompt_ids):
        raise SystemExit("the template does not render the prompt as the start of the turn")
    completion = list(full[len(prompt_ids):])
    parsed = tok.parse_response(completion, prefix=list(prompt_ids), tools=[calculator])
    want = [{"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "48/2"}}}]
    if parsed.get("tool_calls") != want:
        raise SystemExit(f"TRL's parse_response does not read the call in "
                         f"{tok.decode(completion)!r}: {parsed}")
    return {"completion": tok.decode(completion), "parsed": parsed}


def sample_parses(tok, model_dir: Path, n: int = 8) -> list[dict]:
    """`n` sampled first turns of the model on the first prompts, and the calls each parser
    reads in them (ours: finetune.datatypes.tool_calls; TRL: parse_response)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.datatypes.tool_calls import parse_tool_calls

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for row in prompt_rows(n):
        ids = tok.apply_chat_template(row["prompt"], tools=[calculator],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        gen = model.generate(torch.tensor([list(ids)]), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=MAX_LENGTH,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        trl_calls = tok.parse_response(gen, prefix=list(ids), tools=[calculator])
        ours = parse_tool_calls(tok.decode(gen, skip_special_tokens=True))
        out.append({"text": tok.decode(gen), "ours": ours,
                    "trl": trl_calls.get("tool_calls", [])})
    return out


def rows_of(clock: Clock) -> list[dict]:
    """One row per step after the first boundary: wall, parts, generated tokens, tool calls
    and completions."""
    out = []
    for i in range(1, len(clock.bounds)):
        s = clock.steps[i]
        wall = clock.bounds[i] - clock.bounds[i - 1]
        rollout, gen = s.get("rollout", 0.0), s.get("generation", 0.0)
        tools = s.get("episodes", 0.0) - s.get("tokenize", 0.0) - gen
        completions = s.get("completions", 0)
        out.append({"step": i, "total": wall, "generation": gen, "tools": tools,
                    "tool_run": s.get("tool_run", 0.0),
                    "scoring": rollout - gen - tools, "training": wall - rollout,
                    "tokens": s["tokens"], "calls": s.get("calls", 0),
                    "failures": s.get("failures", 0), "completions": completions,
                    "calls_per_completion": s.get("calls", 0) / max(completions, 1),
                    "reward": s.get("reward_sum", 0.0) / max(completions, 1)})
    return out


def timed_tool(clock: Clock, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            clock.add("tool_run", time.perf_counter() - start)
    return run


def counting_reward(clock: Clock):
    """`reward`, adding each call's sum to the step's `reward_sum` (the same function)."""
    def score(completions, **kwargs):
        out = reward(completions, **kwargs)
        clock.add("reward_sum", sum(out))
        return out
    score.__name__ = "reward"
    return score


# -- ours ------------------------------------------------------------------------------------

def tokenized_split(cfg, tok, rows: list[dict], dest: Path) -> Path:
    """The prompt rows as the format stage (tasks.format.format_split, the tools' schemas from
    tasks.format.method_tool_schemas rendered by the chat template) and the tokenize stage
    (the `prompt` type's encoder) write them, saved with datasets."""
    import datasets
    import pandas as pd

    from finetune.datatypes.base import DataContext
    from tasks.format import format_split, method_tool_schemas

    ctx = DataContext(ROOT, lambda: tok, load_tools=lambda: method_tool_schemas(cfg))
    formatted, _ = format_split(cfg.data, pd.DataFrame(rows), "train", ctx, 0.0)
    fn, kwargs = cfg.data.datatype.encoder(ctx)
    enc = fn(formatted.to_dict("list"), tok=tok, **kwargs)
    datasets.Dataset.from_dict(dict(enc)).save_to_disk(str(dest))
    return dest


def run_ours(args, model_dir: Path, work: Path) -> dict:
    from engine.process.distributed import setup
    from engine.process.job import RunPaths
    from engine.recipe.grpo.run import GRPORun
    from finetune.config import load_config

    tok = agent_tokenizer(model_dir)
    steps = args.warmup + args.steps
    overrides = {
        "model.name_or_path": str(model_dir), "model.dtype": "float32",
        "peft.use_peft": True, "peft.r": 16, "peft.lora_alpha": 32, "peft.lora_dropout": 0.0,
        "peft.target_modules": "all-linear",
        "data.dataset_type": "prompt", "data.prompt_template": None,
        "data.completion_template": None, "data.chat_template": str(TEMPLATE_FILE),
        "data.max_seq_length": MAX_PROMPT,
        "training.type": "grpo", "training.per_device_train_batch_size": PROMPTS_PER_STEP,
        "training.gradient_accumulation_steps": 1, "training.max_steps": steps,
        "training.seed": SEED, "training.device": "cpu", "training.mixed_precision": "fp32",
        "training.max_grad_norm": 1.0,
        "grpo.num_generations": GENERATIONS, "grpo.max_completion_length": MAX_LENGTH,
        "grpo.temperature": 1.0, "grpo.top_p": 1.0, "grpo.top_k": 0,
        "grpo.beta": 0.0, "grpo.loss_type": "dapo", "grpo.scale_rewards": "group",
        "grpo.reward_funcs": [f"{Path(__file__).resolve()}:reward"],
        "grpo.reward_weights": None,
        "grpo.tools": [f"{Path(__file__).resolve()}:calculator"],
        "grpo.max_tool_calling_iterations": MAX_ITERATIONS,
        "optimizer.name": "AdamW", "optimizer.learning_rate": LR,
        "optimizer.weight_decay": 0.0, "optimizer.kwargs": {"fused": True},
        "scheduler.name": "constant", "scheduler.warmup_steps": 0,
        "checkpoint.save_strategy": "no", "eval.eval_strategy": "no",
        "logging.logging_steps": 1, "logging.report_to": [], "logging.log_level": "warning",
        "logging.disable_tqdm": True, "registry.register_model": False,
    }
    cfg = load_config(ROOT / "params/default.yaml", overrides)
    train = tokenized_split(cfg, tok, prompt_rows(PROMPTS_PER_STEP * steps),
                            work / "tokenized/train")
    paths = RunPaths(project_root=ROOT, train_data=train, eval_data=None,
                     checkpoints=work / "checkpoints", trained=work / "trained",
                     metrics_file=work / "train.json", plots_dir=work / "plots")
    clock = Clock()
    logged: list[float] = []

    class Timed(GRPORun):
        def prepare_model(self):
            super().prepare_model()
            loop = self.episodes.loop
            clock.wrap(loop.inner, "generate", "generation",
                       count=lambda done: int(done.lengths.sum()))
            inner_loop = loop.generate

            def episodes(*a, **k):
                start = time.perf_counter()
                done = inner_loop(*a, **k)
                clock.add("episodes", time.perf_counter() - start)
                clock.add("calls", int(done.tool_calls.sum()))
                clock.add("failures", int(done.tool_failures.sum()))
                clock.add("completions", int(done.ids.shape[0]))
                return done

            loop.generate = episodes
            loop.runner._run = timed_tool(clock, loop.runner._run)
            self.rewards[0] = dataclasses.replace(self.rewards[0], fn=counting_reward(clock))

        def advantages(self, per_func, completions):
            adv, stats = super().advantages(per_func, completions)
            logged.append(float(stats["tools/call_frequency"]))  # as the step logs it
            return adv, stats

        def rollout(self, micro):
            start = time.perf_counter()
            out = super().rollout(micro)
            clock.add("rollout", time.perf_counter() - start)
            return out

        def maybe_evaluate_and_save(self):
            stop = super().maybe_evaluate_and_save()
            clock.boundary()
            return stop

    dist = setup(cfg.distributed, "cpu", os.cpu_count() or 1)  # one rank, every core
    run = Timed(cfg, paths, dist)
    orig_open = run.open_reporters

    def open_reporters():
        orig_open()
        clock.boundary()  # the start of step 1

    run.open_reporters = open_reporters
    result = run.fit()
    import datasets
    import torch

    return {"rows": rows_of(clock), "trainable": result["trainable_params"],
            "total": result["total_params"], "threads": torch.get_num_threads(),
            "logged_call_frequency": logged,
            "prompt_lengths": [len(x) for x in datasets.load_from_disk(str(train))["input_ids"]],
            "first_prompt": tok.decode(datasets.load_from_disk(str(train))["input_ids"][0])}


# -- TRL -------------------------------------------------------------------------------------

def run_trl(args, model_dir: Path, work: Path) -> dict:
    import datasets
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    torch.set_num_threads(os.cpu_count() or 1)  # as our setup() does: one rank, every core
    tok = agent_tokenizer(model_dir)
    check = check_trl_reads_calls(tok)
    steps = args.warmup + args.steps
    data = datasets.Dataset.from_list(prompt_rows(PROMPTS_PER_STEP * steps))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = trl.GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=MAX_LENGTH, temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group",
        max_tool_calling_iterations=MAX_ITERATIONS,
        gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused",
        use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1, max_steps=steps,
        save_strategy="no", eval_strategy="no", seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    clock = Clock()
    logged: list[float] = []

    class Boundaries(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.boundary()

        def on_step_end(self, *a, **k):
            clock.boundary()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "tools/call_frequency" in logs:
                logged.append(logs["tools/call_frequency"])

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[counting_reward(clock)], args=config,
                              train_dataset=data, processing_class=tok, tools=[calculator],
                              peft_config=peft_config, callbacks=[Boundaries()])
    if trainer.chat_template is not None:
        print("[trl] replaced the chat template with its training template", flush=True)
    clock.wrap(trainer, "_generate_single_turn", "generation",
               count=lambda out: sum(len(ids) for ids in out[0]))
    clock.wrap(trainer, "_tokenize_prompts", "tokenize")
    clock.wrap(trainer, "_generate", "episodes")
    trainer._standalone_tools = [timed_tool(clock, f) for f in trainer._standalone_tools]
    inner_loop = trainer._tool_call_loop

    def tool_call_loop(*a, **k):
        out = inner_loop(*a, **k)
        clock.add("calls", int(out[4]))
        clock.add("failures", int(out[5]))
        clock.add("completions", len(out[2]))
        return out

    trainer._tool_call_loop = tool_call_loop
    clock.wrap(trainer, "_generate_and_score_completions", "rollout")
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    prompt_ids = [tok.apply_chat_template(r["prompt"], tools=[calculator],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for r in data]
    return {"rows": rows_of(clock), "trainable": trainable, "total": total,
            "threads": torch.get_num_threads(), "logged_call_frequency": logged,
            "prompt_lengths": [len(ids) for ids in prompt_ids],
            "first_prompt": tok.decode(prompt_ids[0]), "parse_check": check,
            "training_chat_template": trainer.chat_template is not None}


# -- driver ----------------------------------------------------------------------------------

def worker(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fn = run_ours if args.side == "ours" else run_trl
        out = fn(args, Path(args.model_dir), Path(tmp))
    Path(args.out).write_text(json.dumps(out))


def launch(side: str, args) -> dict:
    busy = wait_for_quiet(args.quiet, args.patience) if args.quiet else None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(args.model_dir),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        result = json.loads(out.read_text())
    result["others_running_before"] = busy
    result["load_after"] = loadavg()
    return result


def run_medians(result: dict, warmup: int) -> dict:
    rows = result["rows"][warmup:]
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("total", *PARTS, "tokens", "calls_per_completion", "reward")}
    med["spread"] = (max(r["total"] for r in rows) - min(r["total"] for r in rows)) / med["total"]
    med["calls_per_completion_mean"] = (sum(r["calls"] for r in rows)
                                        / max(sum(r["completions"] for r in rows), 1))
    return med


def wait_for_model(model_dir: Path, poll: float = 30.0) -> None:
    while not ((model_dir / "config.json").exists()
               and any(model_dir.glob("*.safetensors"))
               and (model_dir / "tokenizer_config.json").exists()):
        print(f"waiting for {model_dir} ...", flush=True)
        time.sleep(poll)


def check(args) -> None:
    """TRL reads a rendered call; what each parser reads in a few sampled first turns."""
    tok = agent_tokenizer(args.model_dir)
    template = TEMPLATE_FILE.read_text()
    print("tokenizer template is calculator-chat.jinja:", tok.chat_template == template)
    from transformers.utils import get_json_schema

    schema = json.loads((ROOT / "data/source/gsm8k-tools/tools.json").read_text())[0]
    ours = get_json_schema(calculator)
    ours["function"].pop("return", None)  # `-> str`, as Calculator.calculator's; not rendered
    print("calculator schema is tools.json's:", ours == schema)
    print(json.dumps(check_trl_reads_calls(tok), indent=1))
    agree = 0
    samples = sample_parses(tok, args.model_dir)
    for s in samples:
        ours = [(c["name"], c["arguments"]) for c in s["ours"]]
        trl_ = [(c["function"]["name"], c["function"]["arguments"]) for c in s["trl"]]
        agree += ours == trl_
        print(f"{s['text']!r}\n  ours {ours}\n  trl  {trl_}")
    print(f"parsers agree on {agree}/{len(samples)} sampled first turns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                        help="the calculator agent's SFT model (make sft-agent)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps dropped before timing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each side, alternating TRL then ours")
    parser.add_argument("--quiet", type=float, default=0.5,
                        help="before each run, wait until fewer than this many other "
                        "processes are runnable (0: do not wait); see --patience")
    parser.add_argument("--patience", type=float, default=120,
                        help="seconds to wait for --quiet before running anyway")
    parser.add_argument("--check", action="store_true",
                        help="check that TRL reads the calls (and sample a few); no timing")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        worker(args)
        return
    wait_for_model(args.model_dir)
    if args.check:
        check(args)
        return

    import peft
    import torch
    import transformers
    import trl

    from workdir import machine, markdown_table

    started, load_before = time.time(), loadavg()
    res = {"trl": [], "ours": []}
    for _ in range(args.rounds):
        for side in ("trl", "ours"):
            res[side].append(launch(side, args))
            print(f"{side}: {[round(r['total'], 3) for r in res[side][-1]['rows']]} s/step",
                  flush=True)
    med = {}
    for side, runs in res.items():
        rounds = [run_medians(r, args.warmup) for r in runs]
        med[side] = {**min(rounds, key=lambda m: m["total"]),
                     "round_totals": [m["total"] for m in rounds]}
    rows = []
    for side in ("trl", "ours"):
        m = med[side]
        rows.append({"trainer": side, "step_s": m["total"], "generation_s": m["generation"],
                     "tools_s": m["tools"], "tool_run_s": m["tool_run"],
                     "scoring_s": m["scoring"], "training_s": m["training"],
                     "tokens": int(m["tokens"]), "calls/completion": m["calls_per_completion"],
                     "reward": m["reward"], "spread": m["spread"],
                     "others": max((r["others_running_before"] or 0) for r in res[side]),
                     "load": max(r["load_after"][0] for r in res[side])})
    ratio = {p: med["trl"][p] / med["ours"][p] if med["ours"][p] else None
             for p in ("total", "generation", "tools", "tool_run", "scoring", "training")}
    rows.append({"trainer": "TRL / ours", "step_s": ratio["total"],
                 "generation_s": ratio["generation"], "tools_s": ratio["tools"],
                 "tool_run_s": ratio["tool_run"], "scoring_s": ratio["scoring"],
                 "training_s": ratio["training"]})
    columns = ["trainer", "step_s", "generation_s", "tools_s", "tool_run_s", "scoring_s",
               "training_s", "tokens", "calls/completion", "reward", "spread", "others", "load"]
    print()
    print(markdown_table(rows, columns))
    target = 1.5
    calls = {s: med[s]["calls_per_completion_mean"] for s in med}
    print(f"\nTRL / ours per step: {ratio['total']:.2f}x (target >= {target}x: "
          f"{'met' if ratio['total'] >= target else 'not met'}); tool calls per completion "
          f"(timed steps): TRL {calls['trl']:.2f}, ours {calls['ours']:.2f}; {args.steps} "
          f"timed steps after {args.warmup}; load before {load_before}, after {loadavg()}")
    info = machine()
    info["threads"] = res["ours"][0]["threads"]
    info["trl_threads"] = res["trl"][0]["threads"]
    info["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__,
                        "peft": peft.__version__, "torch": torch.__version__}
    name = "cpu" if info["device"] == "cpu" else info["device"].lower().replace(" ", "-")
    out = ROOT / f"bench/results/{RESULT}-{name}.json"
    settings = {"model_dir": str(args.model_dir), "chat_template": str(
                    TEMPLATE_FILE.relative_to(ROOT)),
                "prompts": str(PROMPTS.relative_to(ROOT)),
                "prompts_per_step": PROMPTS_PER_STEP, "num_generations": GENERATIONS,
                "trl_per_device_train_batch_size": PROMPTS_PER_STEP * GENERATIONS,
                "max_completion_length": MAX_LENGTH,
                "max_tool_calling_iterations": MAX_ITERATIONS, "max_prompt_tokens": MAX_PROMPT,
                "gradient_accumulation_steps": 1, "temperature": 1.0, "loss_type": "dapo",
                "beta": 0.0, "lora": {"r": 16, "alpha": 32, "dropout": 0.0,
                                      "target_modules": "all-linear"},
                "optimizer": "AdamW fused", "learning_rate": LR, "scheduler": "constant",
                "tools": ["bench/grpo_tools_vs_trl.py:calculator"],
                "reward": "bench/grpo_tools_vs_trl.py:reward", "seed": SEED, "dtype": "float32",
                "trl_response_template": RESPONSE_TEMPLATE,
                "trainable_params": {s: res[s][0]["trainable"] for s in res},
                "total_params": {s: res[s][0]["total"] for s in res},
                "prompt_lengths": {s: res[s][0]["prompt_lengths"][:8] for s in res},
                "first_prompt": {s: res[s][0]["first_prompt"] for s in res}}
    out.write_text(json.dumps({
        "machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                  for k, v in vars(args).items()
                                  if k not in ("side", "out", "check")},
        "settings": settings, "load_before": load_before, "load_after": loadavg(),
        "wall_s": round(time.time() - started, 1), "target_ratio": target,
        "ratio_trl_over_ours": ratio, "calls_per_completion": calls,
        "logged_call_frequency": {s: [r["logged_call_frequency"] for r in res[s]] for s in res},
        "rows": rows, "median": med, "runs": res}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
