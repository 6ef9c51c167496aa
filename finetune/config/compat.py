"""Which options combine: every rule that relates two or more options, as one table.

A row is about one option (`key`, the one a user set) and says where it does not apply:
- `Refuse`: in use, it does not combine with a setting of other options (`where`), and why;
- `Needs`: in use, it needs another setting (`needs`), and why;
- `Agree`: values of several options that must agree (arithmetic), with its own message.
Rows whose option belongs to the machine (CUDA-only features) are checked where the device is
known (`check_machine`: `finetune validate` and the train stage, before any process starts).

Each section's validator runs its scope's rows (`check(section, scope)`), so a section alone
(a data source, a training section built by a test) is checked as the whole file is, and the
error names the keys relative to the section the loader names. The params reference's
"applies to" column (docs/reference.md) and tests/test_compat.py (one example per row that must
be refused) derive from the rows.
The rows that belong to one thing are declared beside it and join the table when its module
is imported: a section's with `add_rows` (peft's in finetune/config/model.py, the pipeline's in
finetune/config/pipeline.py, each method's beside its section), a model kind's as data on its
`ModelTask` (`refuses`: finetune/datatypes/base.py; a row each, `_kind_rows`), the one between
the method and the data at the config's root (finetune/config/schema.py). So a new method,
section or model kind brings its rows with it, and this file names none of them
(tests/test_layering.py). Rules among one dataset type's own keys live with the type
(finetune/datatypes), which is one module by design.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from finetune.datatypes.base import MODEL_TASKS

#: the contexts sections are checked in, in the order the table lists them
SCOPES = ("model", "scheduler", "training", "distributed.fsdp", "distributed.diloco",
          "distributed.pipeline", "distributed", "data", "data.sources", "registry",
          "logging.profiler", "config", "machine")


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def shown(value) -> str:
    """A value as a params file writes it (true, null, 3, a string as is; a section: {...})."""
    if isinstance(value, str):
        return value
    if hasattr(value, "model_fields"):
        return "{...}"
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _set(value) -> bool:
    return value not in (None, False, 0, "", [], {}, ())


@dataclass(frozen=True)
class When:
    """A setting of other options, named as messages and the docs say it (`name`, or
    `said(obj)` where the message names the value the setting has)."""

    name: str
    holds: Callable[[Any], bool]
    said: Callable[[Any], str] | None = None

    def named(self, obj) -> str:
        return self.said(obj) if self.said else self.name


@dataclass(frozen=True)
class Refuse:
    """`key`, in use, does not combine with `where`."""

    scope: str
    key: str
    where: When
    why: str
    used: Callable[[Any], bool] | None = None  # default: the key is set (not false/null/0)
    #: overrides (dotted, from the top) that make the row refuse: tests/test_compat.py
    example: dict = field(default_factory=dict)

    def in_use(self, obj) -> bool:
        return self.used(obj) if self.used else _set(_get(obj, self.key))

    def broken(self, obj) -> str | None:
        if self.in_use(obj) and self.where.holds(obj):
            return (f"{self.key}: {shown(_get(obj, self.key))} does not combine with "
                    f"{self.where.named(obj)} ({self.why})")
        return None


@dataclass(frozen=True)
class Needs:
    """`key`, in use, needs `needs`."""

    scope: str
    key: str
    needs: When
    why: str
    used: Callable[[Any], bool] | None = None
    example: dict = field(default_factory=dict)

    def in_use(self, obj) -> bool:
        return self.used(obj) if self.used else _set(_get(obj, self.key))

    def broken(self, obj) -> str | None:
        if self.in_use(obj) and not self.needs.holds(obj):
            return (f"{self.key}: {shown(_get(obj, self.key))} needs {self.needs.name} "
                    f"({self.why})")
        return None


@dataclass(frozen=True)
class Agree:
    """Values of `keys` that must agree; `message(obj)` says how they do not (None: they do)."""

    scope: str
    keys: tuple[str, ...]
    message: Callable[[Any], str | None]
    example: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.keys[0]

    def broken(self, obj) -> str | None:
        return self.message(obj)


Rule = Refuse | Needs | Agree


def add_rows(scope: str, rows: list[Rule]) -> None:
    """A section's own rows, declared beside the section (finetune/config/preference.py's
    `ROWS` for `dpo`) and added when its module is imported: they join the table, so
    validation, the params reference and tests/test_compat.py treat them as the rows here.
    Rows among the section's keys have its `scope` (its validator runs them); rows across
    sections ("config") come after the table's own, whose order decides which broken row a
    params file is told of first."""
    stray = [f"{r.scope}:{r.key}" for r in rows if r.scope not in (scope, "config")]
    if stray:
        raise ValueError(f"add_rows({scope!r}): rows of another section's scope: {stray}")
    RULES.extend(rows)


def offline_method_refusals(when: When, example: dict, scored: str, rows: str,
                            batches: str, loss: str) -> list[Rule]:
    """The rows every offline preference method (dpo, reward, kto) shares: what its loop
    cannot be combined with, in one line each. `scored`: how a row is scored ("each side of
    a pair"); `rows`: what the tokenized split holds ("pairs"); `batches`: what the trainer
    batches itself; `loss`: whose the loss is. One builder, so a new method refuses the same
    things with the same words, and a new refusal reaches every method."""
    padded = f"{scored} is scored as one padded row"
    return [Refuse("config", key, when, why, used=used, example={**example, **extra})
            for key, used, why, extra in (
        ("training.packing", None, padded, {"training.packing": True}),
        ("training.padding_free", None, padded, {"training.padding_free": True}),
        ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
         "the pipeline's last stage computes the SFT loss; use single, ddp or fsdp2",
         {"distributed.strategy": "pipeline", "distributed.nproc_per_node": 2}),
        ("data.streaming", None, f"{rows} are read from the tokenized split",
         {"data.streaming": True}),
        ("data.collate_fn", lambda c: c.data.user_collate_fn is not None,  # dynamic_padding
         f"the trainer batches {batches} itself", {"data.collate_fn": "m:f"}),
        ("training.compute_loss_func", None, f"the loss is {loss}",
         {"training.compute_loss_func": "m:f"}),
        ("training.use_liger_kernel", None, "its fused loss is the SFT cross entropy",
         {"training.use_liger_kernel": True}),
        ("training.fused_loss_factory", None, "a fused loss is the SFT cross entropy",
         {"training.fused_loss_factory": "m:f"}))]


def check(obj, scope: str) -> None:
    """Run the rows of `scope` on `obj` (the section, or the config); the first broken one is
    a ValueError with its one line."""
    for rule in RULES:
        if rule.scope == scope:
            message = rule.broken(obj)
            if message:
                raise ValueError(message)


class Machine:
    """What the machine rows look at: the config's sections, and the device the run gets."""

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device

    def __getattr__(self, name: str):
        return getattr(self.cfg, name)


def check_machine(cfg, device, sections: tuple[str, ...] | None = None) -> None:
    """The machine's rows, for `device` (a torch.device); a broken one raises PipelineError
    (this runs outside validation: `finetune validate`, the train stage and its workers, and,
    for the model section only, the stages that load a model). `sections`: only the rows
    whose option is in one of them."""
    from finetune.errors import PipelineError

    machine = Machine(cfg, device)
    for rule in RULES:
        if rule.scope == "machine" and (sections is None
                                        or rule.key.split(".")[0] in sections):
            message = rule.broken(machine)
            if message:
                raise PipelineError(message)


def rules_for(dotted: str) -> list[Rule]:
    """The rows about one option (its full dotted key), for the params reference
    (docs/reference.md)."""
    return [r for r in RULES if full_key(r) == dotted]


def full_key(rule: Rule) -> str:
    """A row's option as a full dotted key (rows of a section name keys relative to it)."""
    if rule.scope in ("config", "machine"):
        return rule.key
    return f"{rule.scope.removesuffix('.sources')}.{rule.key}"


def applies_to(dotted: str) -> str:
    """The params reference's column: where the option does not apply, in a few words."""
    parts = []
    for rule in rules_for(dotted):
        if isinstance(rule, Refuse):
            parts.append(f"not with {rule.where.name}")
        elif isinstance(rule, Needs):
            parts.append(f"needs {rule.needs.name}")
    return "; ".join(dict.fromkeys(parts))


# -- the settings rows refer to ----------------------------------------------------------------

def _world(c) -> int:
    return c.distributed.nproc_per_node * c.distributed.nnodes


PIPELINE = When("distributed.strategy pipeline", lambda c: c.distributed.strategy == "pipeline")
FSDP = When("FSDP2 sharding (strategy fsdp2, or diloco with fsdp_group_size > 1)",
            lambda c: c.distributed.shards_with_fsdp)
META = When("training.construct_model_on meta",
            lambda c: c.training.construct_model_on == "meta")
STREAMING = When("data.streaming", lambda c: c.data.streaming)
STORED = When("data.streaming: true", lambda c: c.data.streaming)
DILOCO = When("distributed.strategy diloco", lambda c: c.distributed.strategy == "diloco")
SINGLE = When("distributed.strategy single", lambda c: c.distributed.strategy == "single")
PACKED = When("training.packing or training.padding_free",
              lambda c: c.training.packing or c.training.padding_free)
NO_NOMINAL_EPOCH = When("data.streaming without training.epoch_train_steps",
                        lambda c: c.data.streaming and c.training.epoch_train_steps is None)
EVALUATING = When("in-training evaluation (eval.eval_strategy steps or epoch)",
                  lambda c: c.eval.effective_eval_strategy != "no")
METRIC = When("checkpoint.metric_for_best_model (e.g. eval_loss)",
              lambda c: c.checkpoint.metric_for_best_model is not None)
CUDA = When("a CUDA GPU", lambda m: m.device.type == "cuda")
QUANTIZED = When("model.load_in_4bit or model.load_in_8bit",
                 lambda c: c.model.load_in_4bit or c.model.load_in_8bit)


def _fp8_gpu(m) -> bool:
    import torch

    return m.device.type == "cuda" and torch.cuda.get_device_capability(m.device) >= (8, 9)


FP8_GPU = When("a CUDA GPU of compute capability >= 8.9 (H100, L4, RTX 40xx)", _fp8_gpu)


def _in(name: str, test) -> When:
    """A setting of this section's own options, named by its key."""
    return When(name, test)


def _kind_rows(task) -> list[Rule]:
    """A model kind's refusals (finetune.datatypes.base.ModelTask.refuses, declared beside
    the kind): one row each, where the dataset trains that kind."""
    where = When(task.described, lambda c, task=task: c.data.task == task)
    return [Refuse("config", key, where, why, used=used, example={**task.selected_by, **extra})
            for key, used, why, extra in task.refuses]


# -- messages of the arithmetic rows ---------------------------------------------------------


def _global_batch(c) -> str | None:
    t = c.training
    if t.global_batch_size is None:
        return None
    derived = t.per_device_train_batch_size * t.gradient_accumulation_steps * _world(c)
    if derived == t.global_batch_size:
        return None
    return (f"training.global_batch_size {t.global_batch_size} != per_device_train_batch_size "
            f"{t.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} x world size {_world(c)} = {derived}")


def _diloco_total(c) -> str | None:
    if c.distributed.diloco is None or c.distributed.strategy != "diloco":
        return None
    d = c.distributed.diloco
    total = d.inner_steps * d.diloco_loops
    if c.training.max_steps > 0 and c.training.max_steps != total:
        return (f"training.max_steps {c.training.max_steps} != distributed.diloco.inner_steps "
                f"{d.inner_steps} x diloco_loops {d.diloco_loops} = {total} (a worker's total "
                "optimizer steps); fix one of them, or set training.max_steps: -1")
    return None


def _diloco_multiple(key: str, strategy_key: str) -> Callable[[Any], str | None]:
    def message(c) -> str | None:
        if c.distributed.diloco is None or c.distributed.strategy != "diloco":
            return None
        h, every = c.distributed.diloco.inner_steps, _get(c, key)
        if _get(c, strategy_key) == "steps" and every % h:
            where = ("evaluate the global model, at an outer-loop end" if key.startswith("eval")
                     else "checkpoints are taken at sync points")
            return (f"{key} {every} must be a multiple of distributed.diloco.inner_steps {h} "
                    f"under diloco ({where})")
        return None
    return message


def _local_start(d) -> str | None:
    start, h = d.local_sgd_start_step, d.inner_steps
    if start % h:
        return (f"local_sgd_start_step {start} must be a multiple of inner_steps {h} (outer "
                "syncs fall on multiples of H)")
    if start >= h * d.diloco_loops:
        return (f"local_sgd_start_step {start} >= total steps {h * d.diloco_loops}: the run "
                "would never go local")
    return None


def _model_task(c) -> str | None:
    """A model class or peft task set by hand must be the model task's (it derives them): the
    trainer type's when it names one (finetune.config.methods), else the dataset type's."""
    from finetune.config.methods import method_of
    task = c.model_task
    tasks = {*MODEL_TASKS, task}
    decided_by = (f"training.type {c.training.type}" if method_of(c.training.type).task
                  else f"data.dataset_type {c.data.dataset_type}")
    for section, key, wanted, known in (
            ("model", "auto_class_name", task.auto_class, {t.auto_class for t in tasks}),
            ("peft", "task_type", task.peft_task_type, {t.peft_task_type for t in tasks})):
        value = getattr(getattr(c, section), key)
        if value in known - {wanted}:
            return (f"{section}.{key}: {value} does not fit {decided_by} (it trains "
                    f"{task.auto_class} with peft task {task.peft_task_type}); remove it")
    return None


def _gate_reported(c) -> str | None:
    """The gate decides a registration: a run that registers nothing has no gate to check."""
    if not c.registry.register_model:
        return None
    return _reported(c, c.registry.gate_metric, "registry.gate_metric")


def _reported(c, metric: str, key: str) -> str | None:
    """Whether the evaluate stage reports `metric` (named by `key`) for this run."""
    gate = metric.removeprefix("eval.")
    if gate.startswith("harness."):  # which metrics a task reports: the evaluate stage checks
        return None if c.eval.harness.tasks else (
            f"{key} {metric} names a harness metric, and "
            "eval.harness.tasks is empty; name the task there")
    from finetune.config.methods import method_of

    method = method_of(c.training.type)
    if method.metrics:  # the method's evaluation reports these, not the dataset type's
        reported, by = set(method.reported(c)), f"training.type {c.training.type}"
    else:
        reported = {m for _, part in c.data.parts() for m in part.datatype.reported_metrics()}
        by = f"data.dataset_type {c.data.dataset_type}"
    if gate in reported:
        return None
    return (f"{key} eval.{gate} is not reported for {by} (it reports "
            f"{', '.join('eval.' + m for m in sorted(reported))})")


def has_stderr(c, metric: str) -> bool:
    """Whether the evaluate stage reports a standard error for `metric` (a validated metric
    name): lm-eval does for its tasks' metrics; ours carry a bootstrap one over the held-out
    rows (eval.bootstrap_samples > 0, engine.evaluation.bootstrap) when they are means over
    rows or a token-weighted loss, except: macro-F1 (of the whole set), a classifier's loss,
    the loss and perplexity under a project's data.collate_fn (its batch rows need not be
    examples), and what a method says of its own numbers (finetune.config.methods.Method.stderr:
    GRPO's rewards, KTO's reward_margin, a reward model's pair loss)."""
    from finetune.config.methods import method_of

    if metric.startswith("eval.harness."):
        return True
    if not c.eval.bootstrap_samples:
        return False
    name, method = metric.removeprefix("eval."), method_of(c.training.type)
    verdict = method.stderr(c, name) if method.stderr else None
    if verdict is not None:  # the method's own numbers (finetune.config.methods.Method.stderr)
        return verdict
    if name == "macro_f1":
        return False
    if name in ("loss", "perplexity"):
        return not c.data.task.classifier and c.data.user_collate_fn is None
    return True


def _why_no_stderr(c) -> str:
    if not c.eval.bootstrap_samples:
        return "eval.bootstrap_samples is 0; harness metrics have lm-eval's"
    return "not a mean over held-out rows here; harness metrics have lm-eval's"


def _guards(c) -> str | None:
    """Each registry.guard_metrics entry: one allowance, a stderr for stderr units, and a
    harness metric only with harness tasks; min_improvement_stderr needs a stderr too."""
    r = c.registry
    if not r.register_model:  # they decide a registration, and there is none
        return None
    if r.min_improvement_stderr and not has_stderr(c, r.gate_metric):
        return (f"registry.min_improvement_stderr: {r.gate_metric} reports no standard error "
                f"({_why_no_stderr(c)}); use registry.min_improvement")
    for i, guard in enumerate(r.guard_metrics):
        at = f"registry.guard_metrics[{i}]"
        if (guard.max_drop is None) == (guard.max_drop_stderr is None):
            return (f"{at}.max_drop: set exactly one of max_drop and max_drop_stderr for "
                    f"{guard.metric}")
        if guard.max_drop_stderr is not None and not has_stderr(c, guard.metric):
            return (f"{at}.max_drop_stderr: {guard.metric} reports no standard error "
                    f"({_why_no_stderr(c)}); use max_drop")
        unreported = _reported(c, guard.metric, f"{at}.metric")
        if unreported:
            return unreported
        if guard.metric == r.gate_metric:
            return f"{at}.metric: {guard.metric} is registry.gate_metric already"
    return None


def _gate_computed(c) -> str | None:
    from finetune.datatypes.metrics import GENERATION_METRICS, ROUGE_KEYS, TOOL_CALL_KEYS

    r = c.registry
    if not r.register_model:
        return None
    name = r.gate_metric.removeprefix("eval.")
    needed = ("rouge" if name in ROUGE_KEYS else "tool_calls" if name in TOOL_CALL_KEYS
              else name)
    if needed in GENERATION_METRICS and needed not in c.eval.generation_metrics:
        return (f"registry.gate_metric {r.gate_metric} needs '{needed}' in "
                f"eval.generation_metrics (now {c.eval.generation_metrics})")
    return None


def _best_model_cadence(c) -> str | None:
    ck, e = c.checkpoint, c.eval
    if not ck.load_best_model_at_end:
        return None
    if ck.save_strategy != e.eval_strategy and not e.eval_on_save:
        return (f"checkpoint.load_best_model_at_end: save_strategy {ck.save_strategy} and "
                f"eval.eval_strategy {e.eval_strategy} differ; make them equal or set "
                "eval.eval_on_save: true")
    if (ck.save_strategy == "steps" and e.eval_strategy == "steps" and not e.eval_on_save
            and e.eval_steps and ck.save_steps % e.eval_steps):
        return (f"checkpoint.load_best_model_at_end: save_steps {ck.save_steps} must be a "
                f"multiple of eval.eval_steps {e.eval_steps} (or set eval.eval_on_save)")
    return None


#: what in-training evaluation always reports (the loss over eval.eval_batches)
LOSS_METRICS = ("eval_loss", "eval_perplexity")


def _during_training_metrics(c) -> str | None:
    """eval.during_training_metrics generates with the SFT run's model on a language model's
    rows, and scores what eval.generation_metrics names; harness metrics it names run lm-eval
    on one process's whole model."""
    e = c.eval
    if not e.during_training_metrics:
        return None
    from finetune.config.methods import method_of

    key = "eval.during_training_metrics"
    named = _named_not_reported(c) if isinstance(e.during_training_metrics, list) else None
    if named:
        return named
    if not method_of(c.training.type).sft_evaluation:
        return (f"{key}: training.type {c.training.type} evaluates with its own numbers "
                "during training, not the generation metrics (set it to false)")
    harness = harness_in_training(c)
    strategy = c.distributed.resolved_strategy
    if harness and strategy not in ("single", "ddp"):
        how = "keeps diverging replicas" if strategy == "diloco" else "splits it across ranks"
        return (f"{key}: {harness[0]} runs lm-eval on one process's whole model, and "
                f"distributed.strategy {strategy} {how}; use single or ddp, or leave harness "
                "metrics to the evaluate stage")
    if e.during_training_metrics is not True and len(harness) == len(e.during_training_metrics):
        return None  # harness metrics only: no generation rows needed
    if c.data.task.classifier:
        return (f"{key}: data.dataset_type {c.data.dataset_type} trains a classifier, which "
                f"generates no text (set {key}: false)")
    if not e.generation_metrics:
        return (f"{key}: eval.generation_metrics is empty; name the metrics to score "
                "(exact_match, rouge, tool_calls)")
    if c.distributed.pipeline is not None:
        return (f"{key}: the pipeline strategy splits the model across ranks and cannot "
                "generate; set it to false")
    return None


def harness_in_training(c) -> tuple[str, ...]:
    """The lm-eval metrics eval.during_training_metrics names, as the evaluate stage's
    eval.json spells them: harness.<task>.<metric>.<filter>."""
    picked = c.eval.during_training_metrics
    return (tuple(m for m in picked if m.startswith("harness."))
            if isinstance(picked, list) else ())


#: harness.<task>.<metric>.<filter>, as the evaluate stage's eval.json has them
HARNESS_METRIC = re.compile(r"harness\.([^.\s]+)\.[^.\s]+\.[^.\s]+")


def _harness_named(c, name: str) -> str | None:
    """A harness metric in eval.during_training_metrics: spelled as eval.json has it, of a
    task eval.harness.tasks lists (a task file's stem or a task name; a folder of task files
    is resolved, and its task names checked, when the train stage starts)."""
    from pathlib import PurePath

    key, tasks = "eval.during_training_metrics", c.eval.harness.tasks
    matched = HARNESS_METRIC.fullmatch(name)
    if matched is None:
        return (f"{key}: {name} is not a harness metric as the evaluate stage reports it: "
                "harness.<task>.<metric>.<filter> (e.g. "
                "harness.gsm8k_local.exact_match.flexible-extract)")
    task = matched.group(1)
    if not tasks:
        return (f"{key}: {name} is an lm-evaluation-harness metric of task {task}, and "
                "eval.harness.tasks is empty; list the task there (the evaluate stage runs it "
                "too)")
    files = {PurePath(t).stem for t in tasks if t.endswith((".yaml", ".yml"))}
    names = {t for t in tasks if "/" not in t and not t.endswith((".yaml", ".yml"))}
    folders = [t for t in tasks if "/" in t and not t.endswith((".yaml", ".yml"))]
    if task in files or task in names or folders:
        return None
    return (f"{key}: {name} is of task {task}, which eval.harness.tasks does not list (now "
            f"{', '.join(tasks)}; a task file counts by its name here: {task}.yaml)")


def _named_not_reported(c) -> str | None:
    """A name in an eval.during_training_metrics list that is not a generation metric of
    eval.generation_metrics: a rollout method's rewards and pass@k, an lm-eval harness task,
    or nothing the evaluate stage reports."""
    from pathlib import PurePath

    from finetune.config.methods import method_of
    from finetune.datatypes.generations import generation_metric_names, metric_names
    from finetune.datatypes.metrics import GENERATION_METRICS

    key, e = "eval.during_training_metrics", c.eval
    allowed = {*generation_metric_names(c, chosen=False), *e.generation_metrics}
    tasks = {t: PurePath(t).stem for t in e.harness.tasks}
    for name in e.during_training_metrics:
        if name in allowed:
            continue
        if name.startswith("harness."):
            refused = _harness_named(c, name)
            if refused:
                return refused
            continue
        method = method_of(c.training.type)
        if method.metrics is not None and name in method.metrics(c):
            return (f"{key}: {name} is the evaluate stage's (training.type "
                    f"{c.training.type}); during training it logs its own numbers (a "
                    "rollout method: eval_reward, greedy over eval.eval_batches, which "
                    "checkpoint.metric_for_best_model may name), and pass@k and sampled "
                    "rewards draw k completions per prompt, which only the evaluate stage "
                    f"does; set {key}: false")
        group = next((g for g in GENERATION_METRICS if name in metric_names([g])), None)
        if group is not None:
            return (f"{key}: {name} needs '{group}' in eval.generation_metrics (now "
                    f"{e.generation_metrics})")
        if name in tasks or name in tasks.values():
            return (f"{key}: {name} is an lm-evaluation-harness task (eval.harness.tasks); "
                    "name its metrics as the evaluate stage reports them, "
                    f"harness.{tasks.get(name, name)}.<metric>.<filter> (e.g. "
                    "harness.gsm8k_local.exact_match.flexible-extract)")
        return (f"{key}: {name} is not a metric the evaluate stage reports for this run "
                f"(generation metrics: {', '.join(sorted(allowed)) or 'none'}; harness "
                "metrics: harness.<task>.<metric>.<filter> of eval.harness.tasks, now "
                f"{'empty' if not tasks else ', '.join(tasks)})")
    return None


def _in_training_metrics(c) -> tuple[str, ...]:
    """What an in-training evaluation of this config reports (metric_for_best_model's
    choices)."""
    from finetune.config.methods import method_of
    from finetune.datatypes.generations import generation_metric_names

    if method_of(c.training.type).default_gate == "eval.reward":
        return ("eval_reward",)  # a rollout method's: engine.recipe.grpo.heldout.greedy_rewards
    generated = ((*generation_metric_names(c), *harness_in_training(c))
                 if c.eval.during_training_metrics and not _during_training_metrics(c) else ())
    return (*LOSS_METRICS, *(f"eval_{m}" for m in generated))


def _best_metric_reported(c) -> str | None:
    """checkpoint.metric_for_best_model names a metric that in-training evaluation reports."""
    from finetune.datatypes.metrics import ROUGE_KEYS, TOOL_CALL_KEYS

    metric = c.checkpoint.metric_for_best_model
    if metric is None or metric in _in_training_metrics(c):
        return None
    key, name = "checkpoint.metric_for_best_model", metric.removeprefix("eval_")
    needed = ("rouge" if name in ROUGE_KEYS else "tool_calls" if name in TOOL_CALL_KEYS
              else name)
    from finetune.datatypes.metrics import GENERATION_METRICS

    known = needed in GENERATION_METRICS
    if known and not c.eval.during_training_metrics:
        return (f"{key} {metric} is a generation metric, not measured during training; set "
                f"eval.during_training_metrics: true (or metric_for_best_model: eval_loss)")
    if known and needed not in c.eval.generation_metrics:
        return (f"{key} {metric} needs '{needed}' in eval.generation_metrics (now "
                f"{c.eval.generation_metrics})")
    return (f"{key} {metric} is not reported during training for data.dataset_type "
            f"{c.data.dataset_type} (it reports {', '.join(_in_training_metrics(c))}); set "
            "one of those")


def _threshold_stderr(c) -> str | None:
    """eval.early_stopping_threshold_stderr needs the watched metric's bootstrap stderr: a
    generation metric measured during training, with eval.bootstrap_samples > 0."""
    units = c.eval.early_stopping_threshold_stderr
    if not units:
        return None
    key, metric = "eval.early_stopping_threshold_stderr", c.checkpoint.metric_for_best_model
    if metric is None:
        return f"{key} needs checkpoint.metric_for_best_model (the metric whose stderr it uses)"
    if metric in LOSS_METRICS:
        return (f"{key}: checkpoint.metric_for_best_model {metric} has no standard error "
                "during training (the generation metrics of eval.during_training_metrics "
                "do); use eval.early_stopping_threshold")
    if not c.eval.bootstrap_samples and not metric.startswith("eval_harness."):
        return (f"{key}: {metric} has no standard error with eval.bootstrap_samples 0; set "
                "eval.bootstrap_samples (e.g. 1000) or use eval.early_stopping_threshold")
    return None


def _unknown_fingerprint_key(c) -> str | None:
    from finetune.config.fingerprint import CONTENT_KEYS, config_part

    known = set(config_part(c)) | set(CONTENT_KEYS)
    for key in c.checkpoint.resume_ignore_changes:
        if key not in known:
            return (f"checkpoint.resume_ignore_changes: '{key}' is not part of the checkpoint "
                    "fingerprint (a dotted key such as training.max_steps, or train_data, "
                    "base_model, user_code); keys outside it never block a resume")
    return None


_CUDA_ONLY_WHY = {
    "training.enable_activation_offloading":
        "it moves saved activations from the GPU to host memory, where a CPU run keeps them",
    "training.gc_threshold": "it tunes the CUDA caching allocator",
}
#: the SDPA kernels a CPU has (the others need CUDA)
CPU_SDPA = ("flash_attention", "math")


def _mixture(d) -> str | None:
    """A mixture's own rules (its sources each pass the rest of the table as one-source
    data sections, checked by DataConfig)."""
    if d.sources is None:
        return None
    located = [k for k in ("dataset_name", "json_file_path", "data_files") if getattr(d, k)]
    if located:
        return (f"{located[0]} is set next to data.sources; move it into a source (each "
                "source names its own dataset)")
    if all(s.eval_only for s in d.sources):
        return "sources: every source is eval_only; at least one must train"
    names = [s.name for s in d.sources]
    if len(set(names)) != len(names):
        return f"sources: names must differ (got {', '.join(names)})"
    if d.mixing == "concatenate" and any(s.weight != 1.0 for s in d.sources):
        return ("sources: weights need mixing: interleave (concatenate keeps every row of every "
                "source once)")
    return None


def _one_location(d) -> str | None:
    if d.sources is not None:
        return None
    located = [k for k in ("dataset_name", "json_file_path", "data_files") if getattr(d, k)]
    if len(located) != 1:
        return ("set exactly one of dataset_name, json_file_path, data_files "
                f"(got {', '.join(located) or 'none'})")
    return None


def _type_keys(d) -> str | None:
    """A key that only other dataset types read, set in the params file."""
    from finetune.datatypes.registry import type_keys

    if d.sources is not None:
        return None
    fields = type(d).model_fields
    foreign = sorted(type_keys() - set(d.datatype.keys), key=list(fields).index)
    clash = [k for k in foreign if k in d.model_fields_set
             and getattr(d, k) not in (None, fields[k].default)]
    if clash:
        return (f"{clash[0]} does not apply to dataset_type {d.dataset_type}; remove it or "
                "change data.dataset_type")
    return None


def _task_of_sources(d) -> str | None:
    if d.sources is None:
        return None
    tasks = [(s, part.datatype.task, part.dataset_type)
             for s, (_, part) in zip(d.sources, d.parts())]
    first = tasks[0][1]
    for i, (source, task, name) in enumerate(tasks):
        if task != first:
            return (f"sources[{i}] ({source.name}): dataset_type {name} trains "
                    f"{task.auto_class}, sources[0] {first.auto_class}; the sources of a "
                    "mixture train one model")
    return None


# -- the table ---------------------------------------------------------------------------------

#: the examples' DiLoCo run: 2 outer loops of H = 75 (the default max_steps 150)
DILOCO_H75 = {"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
              "distributed.diloco.diloco_loops": 2}

RULES: list[Rule] = [
    # model
    Refuse("model", "load_in_8bit", _in("load_in_4bit", lambda m: m.load_in_4bit),
           "one quantisation; set one of them to false",
           example={"model.load_in_4bit": True, "model.load_in_8bit": True}),
    Refuse("model", "gguf_file", _in("load_in_4bit or load_in_8bit",
                                     lambda m: m.load_in_4bit or m.load_in_8bit),
           "transformers loads a GGUF file through its own GGUF quantizer and refuses a "
           "bitsandbytes quantization on the same load; set them false to train the "
           "dequantized weights in model.dtype, or point name_or_path at a safetensors copy of "
           "the model to load it in 4 or 8 bits",
           example={"model.gguf_file": "base.gguf", "model.load_in_4bit": True}),
    Refuse("model", "gguf_file", _in("model_init", lambda m: bool(m.model_init)),
           "model_init builds the model itself, so the GGUF file would give only the "
           "tokenizer; name the tokenizer in tokenizer_name_or_path, or remove model_init",
           example={"model.gguf_file": "base.gguf", "model.model_init": "m:f"}),
    # scheduler
    Refuse("scheduler", "warmup_ratio", _in("warmup_steps", lambda s: s.warmup_steps > 0),
           "exclusive: set one of them to 0", example={"scheduler.warmup_ratio": 0.1}),
    Refuse("scheduler", "warmup_type", _in("name", lambda s: ":" in s.name
                                           or s.name == "constant"),
           "log reshapes the warmup of transformers' schedules; constant has none (use "
           "constant_with_warmup) and a 'module:function' schedule shapes its own",
           used=lambda s: s.warmup_type == "log",
           example={"scheduler.warmup_type": "log",
                    "scheduler.name": "transformers:get_constant_schedule_with_warmup"}),
    # training
    Needs("training", "dataloader_prefetch_factor",
          _in("dataloader_num_workers > 0", lambda t: t.dataloader_num_workers > 0),
          "it tunes the loader's worker processes",
          used=lambda t: t.dataloader_prefetch_factor is not None,
          example={"training.dataloader_prefetch_factor": 2}),
    Needs("training", "dataloader_persistent_workers",
          _in("dataloader_num_workers > 0", lambda t: t.dataloader_num_workers > 0),
          "it keeps the loader's worker processes", example={
              "training.dataloader_persistent_workers": True}),
    Refuse("training", "qat_recipe", _in("fp8_recipe", lambda t: bool(t.fp8_recipe)),
           "fp8 trains in fp8; QAT simulates another format: set one",
           example={"training.fp8_recipe": "tensorwise",
                    "training.qat_recipe": "int8-dynamic-act-int4-weight"}),
    Refuse("training", "enable_activation_checkpoint_fn", _in(
        "gradient_checkpointing_kwargs.use_reentrant",
        lambda t: t.gradient_checkpointing_kwargs.use_reentrant),
        "the chosen modules are checkpointed by hooks, which torch runs non-reentrant; set "
        "use_reentrant: false", example={
            "training.enable_activation_checkpoint_fn": "os:getcwd",
            "training.gradient_checkpointing_kwargs.use_reentrant": True}),
    Refuse("training", "use_cpu", _in("device: cuda", lambda t: t.device == "cuda"),
           "they contradict each other; set one",
           example={"training.use_cpu": True, "training.device": "cuda"}),
    Refuse("training", "fuse_optim_with_backward", _in("max_grad_norm", lambda t: t.max_grad_norm
                                                       is not None),
           "clipping needs every gradient before the update; set max_grad_norm: null",
           example={"training.fuse_optim_with_backward": True}),
    Refuse("training", "fuse_optim_with_backward",
           _in("gradient_accumulation_steps > 1", lambda t: t.gradient_accumulation_steps > 1),
           "the update would run on every micro-batch",
           example={"training.fuse_optim_with_backward": True, "training.max_grad_norm": None,
                    "training.gradient_accumulation_steps": 2}),
    Refuse("training", "fuse_optim_with_backward",
           _in("mixed_precision fp16", lambda t: t.mixed_precision == "fp16"),
           "the GradScaler unscales all gradients before the update",
           example={"training.fuse_optim_with_backward": True, "training.max_grad_norm": None,
                    "training.mixed_precision": "fp16"}),
    Needs("training", "dynamo_recompile_limit", _in("torch_compile: true",
                                                    lambda t: t.torch_compile),
          "it tunes torch.compile", used=lambda t: t.dynamo_recompile_limit is not None,
          example={"training.dynamo_recompile_limit": 8}),
    Needs("training", "activation_memory_budget", _in("torch_compile: true",
                                                      lambda t: t.torch_compile),
          "it tunes torch.compile", used=lambda t: t.activation_memory_budget is not None,
          example={"training.activation_memory_budget": 0.5}),
    # torch.compile's own options, set away from their defaults without it: ignored silently
    *(Needs("training", key, _in("torch_compile: true", lambda t: t.torch_compile),
            "it is an option of torch.compile", used=used, example={f"training.{key}": value})
      for key, used, value in (
          ("torch_compile_backend", lambda t: t.torch_compile_backend != "inductor", "eager"),
          ("torch_compile_mode", lambda t: t.torch_compile_mode != "default",
           "reduce-overhead"),
          ("torch_compile_scope", lambda t: t.torch_compile_scope != "blocks", "model"),
          ("torch_compile_dynamic", lambda t: t.torch_compile_dynamic is not None, True),
          ("torch_compile_fullgraph", lambda t: t.torch_compile_fullgraph, True))),
    Agree("training", ("speed_metrics_start_step", "max_steps"), lambda t: (
        f"speed_metrics_start_step {t.speed_metrics_start_step} leaves no step of max_steps "
        f"{t.max_steps} to measure") if 0 < t.max_steps <= t.speed_metrics_start_step else None,
          example={"training.speed_metrics_start_step": 200}),
    Refuse("training", "torch_compile_mode",
           _in("gradient_accumulation_steps > 1", lambda t: t.gradient_accumulation_steps > 1),
           "max-autotune captures CUDA graphs, which replay stale gradients under "
           "accumulation; use max-autotune-no-cudagraphs or accumulation 1",
           used=lambda t: t.torch_compile and t.torch_compile_mode == "max-autotune",
           example={"training.torch_compile": True, "training.torch_compile_mode":
                    "max-autotune", "training.gradient_accumulation_steps": 2}),
    Refuse("training", "torch_compile_fullgraph",
           _in("torch_compile_scope: model with the chunked loss (loss_chunk_tokens)",
               lambda t: t.torch_compile_scope == "model" and bool(t.loss_chunk_tokens)),
           "the chunked loss runs eager, a graph break; use torch_compile_scope: blocks or "
           "loss_chunk_tokens: null",
           used=lambda t: t.torch_compile and t.torch_compile_fullgraph,
           example={"training.torch_compile": True, "training.torch_compile_fullgraph": True,
                    "training.torch_compile_scope": "model"}),
    Refuse("training", "use_liger_kernel",
           _in("compute_loss_func", lambda t: t.compute_loss_func is not None),
           "Liger's fused linear cross entropy is the loss; a loss of full logits cannot be "
           "both; set one",
           example={"training.use_liger_kernel": True, "training.compute_loss_func": "m:f"}),
    *(Refuse("training", "fused_loss_factory", _in(other, lambda t, o=other: bool(
        getattr(t, o))), "one loss: the factory's fused loss or the other; set one", example={
            "training.fused_loss_factory": "m:f", f"training.{other}": value})
      for other, value in (("use_liger_kernel", True), ("compute_loss_func", "m:f"))),
    Refuse("training", "packing", _in("padding_free", lambda t: t.padding_free),
           "alternatives: padding_free puts each micro-batch in one row without padding, "
           "packing in rows of packed_sequence_length; set one",
           example={"training.padding_free": True, "training.packing": True}),
    Agree("training", ("max_steps", "num_train_epochs"), lambda t: (
        "set max_steps > 0 or num_train_epochs > 0; both give no steps")
          if t.max_steps <= 0 and t.num_train_epochs <= 0 else None,
          example={"training.max_steps": -1, "training.num_train_epochs": 0}),
    # distributed sub-sections
    Needs("distributed.fsdp", "shard_modules",
          _in("shard_transformer_layers: true", lambda f: f.shard_transformer_layers),
          "it names units to shard one by one; false shards the root only",
          example={"distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2,
                   "distributed.fsdp.shard_modules": ["model.layers"],
                   "distributed.fsdp.shard_transformer_layers": False}),
    Refuse("distributed.diloco", "post_local_gradient_allreduce",
           _in("fsdp_group_size > 1", lambda d: d.fsdp_group_size > 1),
           "it averages a node's workers' gradients, but each worker is already a group of "
           "sharded processes; set one of them (fsdp_group_size: 1 or "
           "post_local_gradient_allreduce: false)",
           example={"distributed.strategy": "diloco", "distributed.nproc_per_node": 2,
                    "distributed.diloco.inner_steps": 75, "distributed.diloco.diloco_loops": 2,
                    "distributed.diloco.fsdp_group_size": 2, "eval.eval_steps": 75,
                    "checkpoint.save_steps": 75,
                    "distributed.diloco.post_local_gradient_allreduce": True}),
    Agree("distributed.diloco", ("local_sgd_start_step", "inner_steps"), _local_start,
          example={"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
                   "distributed.diloco.diloco_loops": 2, "eval.eval_strategy": "no",
                   "checkpoint.save_strategy": "no",
                   "distributed.diloco.local_sgd_start_step": 300}),
    # distributed
    Agree("distributed", ("strategy", "nproc_per_node", "nnodes"), lambda d: (
        f"strategy 'single' runs one process but nproc_per_node x nnodes = {d.world_size}; use "
        "strategy ddp or set nproc_per_node: 1") if d.strategy == "single" and d.world_size > 1
          else None, example={"distributed.nproc_per_node": 2}),
    Agree("distributed", ("node_rank", "nnodes"), lambda d: (
        f"node_rank {d.node_rank} must be < nnodes {d.nnodes}")
          if d.node_rank >= d.nnodes else None, example={"distributed.node_rank": 1}),
    Needs("distributed", "skip_all_reduce_unused_params",
          _in("find_unused_parameters: true", lambda d: d.find_unused_parameters),
          "DDP finds the unused parameters it skips",
          example={"distributed.skip_all_reduce_unused_params": True}),
    Agree("distributed", ("strategy", "diloco"), lambda d: (
        "strategy 'diloco' needs its outer-loop settings: add a distributed.diloco section (at "
        "least inner_steps; outer_lr, outer_momentum have defaults)")
          if d.strategy == "diloco" and d.diloco is None else None,
          example={"distributed.strategy": "diloco", "eval.eval_steps": 75,
                   "checkpoint.save_steps": 75}),
    Agree("distributed", ("diloco.fsdp_group_size", "nproc_per_node"), lambda d: (
        f"diloco.fsdp_group_size {d.diloco.fsdp_group_size} must divide the world size "
        f"{d.world_size}") if d.diloco is not None and d.world_size % d.diloco.fsdp_group_size
          else None, example={"distributed.strategy": "diloco",
                              "distributed.diloco.inner_steps": 75,
                              "distributed.diloco.diloco_loops": 2,
                              "distributed.diloco.fsdp_group_size": 2,
                              "eval.eval_steps": 75, "checkpoint.save_steps": 75}),
    *(Refuse("distributed", name, When(f"a strategy other than {owner}",
                                        lambda d, owner=owner, name=name: d.strategy != owner
                                        and not (name == "fsdp" and d.diloco is not None
                                                 and d.diloco.fsdp_group_size > 1),
                                        lambda d: f"strategy {d.strategy}"),
             f"the section would be ignored: set strategy: {owner} or remove it",
             used=lambda d, name=name: getattr(d, name) is not None,
             example={f"distributed.{name}.{probe}": value})
      for name, owner, probe, value in (("fsdp", "fsdp2", "cpu_offload", True),
                                        ("diloco", "diloco", "inner_steps", 2),
                                        ("pipeline", "pipeline", "n_microbatches", 2))),
    # data (each source is checked as a one-source section)
    Agree("data", ("dataset_name", "json_file_path", "data_files"), _one_location,
          example={"data.json_file_path": "x.jsonl"}),
    Agree("data", ("sources",), _mixture, example={"data.data_files": None, "data.sources": [
        {"name": "a", "json_file_path": "a.jsonl", "eval_only": True},
        {"name": "b", "json_file_path": "b.jsonl", "eval_only": True}]}),
    Agree("data.sources", ("sources", "dataset_type"), _task_of_sources, example={
        "data.data_files": None, "data.sources": [
            {"name": "a", "json_file_path": "a.jsonl"},
            {"name": "b", "json_file_path": "b.jsonl", "dataset_type": "classification"}]}),
    Agree("data", ("dataset_type",), _type_keys,
          example={"data.chat_template": "{{ messages }}"}),
    Needs("data", "input_columns",
          _in("data.prompt_func or data.completion_func",
              lambda d: bool(d.prompt_func or d.completion_func)),
          "it selects what the functions receive",
          used=lambda d: d.sources is None and bool(d.input_columns),
          example={"data.input_columns": ["question"]}),
    # registry
    Agree("registry", ("candidate_alias", "champion_alias"), lambda r: (
        "candidate_alias and champion_alias must differ")
          if r.candidate_alias == r.champion_alias else None,
          example={"registry.candidate_alias": "champion"}),
    # logging.profiler: every other key says how to trace, which means nothing while it is off
    *(Needs("logging.profiler", key, _in("enabled: true", lambda p: p.enabled),
            "the profiler is off, so nothing would use it",
            used=lambda p, key=key: getattr(p, key) != type(p).model_fields[key].default,
            example={f"logging.profiler.{key}": value})
      for key, value in (("wait_steps", 0), ("warmup_steps", 0), ("active_steps", 4),
                         ("num_cycles", 2), ("record_shapes", True),
                         ("profile_memory", True), ("with_stack", True),
                         ("with_flops", True), ("row_limit", 10),
                         ("output_dir", "data/logs/traces"))),
    # across sections
    Agree("config", ("training.global_batch_size", "training.per_device_train_batch_size",
                     "training.gradient_accumulation_steps", "distributed.nproc_per_node"),
          _global_batch, example={"training.global_batch_size": 64}),
    Agree("config", ("training.max_steps", "distributed.diloco.inner_steps"), _diloco_total,
          example={"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 50,
                   "distributed.diloco.diloco_loops": 2}),
    *(Refuse("config", key, DILOCO,
             "epoch ends are not sync points; use steps with a multiple of H",
             used=lambda c, key=key: _get(c, key) == "epoch",
             example={**DILOCO_H75, key: "epoch", other: 75})
      for key, other in (("eval.eval_strategy", "checkpoint.save_steps"),
                         ("checkpoint.save_strategy", "eval.eval_steps"))),
    Agree("config", ("eval.eval_steps", "distributed.diloco.inner_steps"),
          _diloco_multiple("eval.eval_steps", "eval.eval_strategy"),
          example={"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 75,
                   "distributed.diloco.diloco_loops": 2, "eval.eval_steps": 45,
                   "checkpoint.save_steps": 75}),
    Agree("config", ("checkpoint.save_steps", "distributed.diloco.inner_steps"),
          _diloco_multiple("checkpoint.save_steps", "checkpoint.save_strategy"),
          example={"distributed.strategy": "diloco", "distributed.diloco.inner_steps": 10,
                   "distributed.diloco.diloco_loops": 2, "training.max_steps": 20,
                   "eval.eval_steps": 10, "checkpoint.save_steps": 15}),
    Refuse("config", "training.mixed_precision", FSDP,
           "it would need a sharded GradScaler, which this trainer does not use; use bf16 "
           "(distributed.fsdp.param_dtype: bfloat16)",
           used=lambda c: c.training.mixed_precision == "fp16",
           example={"distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2,
                    "training.mixed_precision": "fp16"}),
    Needs("config", "training.fuse_optim_with_backward", SINGLE,
          "the update would run before the gradients are all-reduced",
          example={"training.fuse_optim_with_backward": True, "training.max_grad_norm": None,
                   "distributed.strategy": "ddp", "distributed.nproc_per_node": 2}),
    Refuse("config", "data.collate_fn", PACKED,
           "their batches are built by the trainer's own packing collators; drop one of them",
           example={"data.collate_fn": "m:f", "training.packing": True}),
    Needs("config", "export.gguf", When("export.formats to list gguf",
                                        lambda c: "gguf" in c.export.formats),
          "the gguf format writes them; add it, or empty export.gguf",
          example={"export.gguf": ["f16"], "export.formats": ["hf"]}),
    *(Refuse("config", key, When(name, holds), why, used=used, example={**example, **extra})
      for key, used, example in (
        ("optimizer.loraplus_lr_ratio", None, {"optimizer.loraplus_lr_ratio": 16}),
        ("peft.trainable_token_indices",
         lambda c: c.peft.trainable_token_indices not in (None, "added"),
         {"peft.trainable_token_indices": [3]}))
      for name, holds, why, extra in (
        ("peft.use_peft: false", lambda c: not c.peft.use_peft,
         "full fine-tuning trains every weight; remove it or set peft.use_peft: true",
         {"peft.use_peft": False}),
        ("peft.peft_type: IA3", lambda c: c.peft.use_peft and c.peft.peft_type == "IA3",
         "it is a LoRA option: IA3 has no A/B matrices nor trainable tokens; use LORA",
         {"peft.peft_type": "IA3"}))),
    Needs("config", "optimizer.loraplus_lr_embedding",
          When("optimizer.loraplus_lr_ratio", lambda c: c.optimizer.loraplus_lr_ratio is not None),
          "it is LoRA+'s rate for LoRA matrices on an embedding; set the ratio too",
          example={"optimizer.loraplus_lr_embedding": 1e-5}),
    Refuse("config", "training.pad_to_multiple_of",
           When("a data.collate_fn of the project (module:function)",
                lambda c: c.data.user_collate_fn is not None),
           "that function decides each batch's width; round it up there, or use "
           "collate_fn: dynamic_padding, which applies pad_to_multiple_of",
           example={"data.collate_fn": "m:f", "training.pad_to_multiple_of": 8}),
    Refuse("config", "checkpoint.save_on_each_node", FSDP,
           "each node would hold the whole training state, which FSDP2 shards across the "
           "nodes; keep the checkpoint folder on storage all nodes share, or use ddp",
           example={"checkpoint.save_on_each_node": True, "distributed.strategy": "fsdp2",
                    "distributed.nproc_per_node": 2}),
    *(Refuse("config", key, META, why + "; use construct_model_on: default or device",
             used=used, example={"training.construct_model_on": "meta", **extra})
      for key, used, why, extra in (
        ("model.model_init", None, "the factory builds the model itself",
         {"model.model_init": "m:f"}),
        ("model.gguf_file", None, "the skeleton's weights are read from safetensors shards; "
         "transformers reads a GGUF file whole, through its own loader",
         {"model.gguf_file": "base.gguf"}),
        ("model.load_in_4bit", None, "quantised loading is from_pretrained's",
         {"model.load_in_4bit": True}),
        ("model.load_in_8bit", None, "quantised loading is from_pretrained's",
         {"model.load_in_8bit": True}),
        ("model.device_map", None, "the strategy places the weights",
         {"model.device_map": "cpu"}),
        ("model.added_tokens", lambda c: bool(c.model.added_tokens or c.model.special_tokens),
         "new embedding rows are the mean of the stored ones",
         {"model.added_tokens": ["<extra>"]}),
        ("training.qat_recipe", None, "QAT swaps the layers being built",
         {"training.qat_recipe": "int8-dynamic-act-int4-weight"}),
        ("distributed.diloco.fsdp_group_size",
         lambda c: c.distributed.diloco is not None and c.distributed.diloco.fsdp_group_size > 1,
         "DiLoCo copies the sharded weights before the shards are read",
         {"distributed.strategy": "diloco", "distributed.nproc_per_node": 2,
          "distributed.diloco.inner_steps": 75, "distributed.diloco.diloco_loops": 2,
          "distributed.diloco.fsdp_group_size": 2, "eval.eval_steps": 75,
          "checkpoint.save_steps": 75}),
    )),
    Needs("config", "data.streaming",
          When("training.max_steps > 0 or training.epoch_train_steps",
               lambda c: c.training.max_steps > 0 or c.training.epoch_train_steps is not None),
          "a stream has no length, so epochs cannot size the run",
          example={"data.streaming": True, "training.max_steps": -1}),
    *(Refuse("config", key, STREAMING, why, used=used, example={"data.streaming": True,
                                                                **extra})
      for key, used, why, extra in (
        ("training.group_by_length", None, "needs every example's length",
         {"training.group_by_length": True}),
        ("training.dataloader_num_workers", None,
         "streamed batches are built in the main process",
         {"training.dataloader_num_workers": 2}),
        ("training.dataloader_drop_last", lambda c: not c.training.dataloader_drop_last,
         "false refills from the epoch start, which a stream cannot revisit",
         {"training.dataloader_drop_last": False}),
    )),
    *(Refuse("config", key, NO_NOMINAL_EPOCH,
             "epoch ends are unknown; set training.epoch_train_steps",
             used=lambda c, key=key: _get(c, key) == "epoch",
             example={"data.streaming": True, key: "epoch"})
      for key in ("eval.eval_strategy", "checkpoint.save_strategy")),
    Needs("config", "training.epoch_train_steps", STORED,
          "it sizes a streamed split's epoch; a stored split knows its length",
          used=lambda c: c.training.epoch_train_steps is not None,
          example={"training.epoch_train_steps": 2}),
    Agree("config", ("model.auto_class_name", "peft.task_type", "data.dataset_type"),
          _model_task, example={"data.dataset_type": "classification",
                                "data.prompt_template": None, "data.completion_template": None,
                                "eval.generation_metrics": [],
                                "model.auto_class_name": "AutoModelForCausalLM"}),
    Agree("config", ("registry.gate_metric", "data.dataset_type"), _gate_reported,
          example={"registry.gate_metric": "eval.accuracy"}),
    Agree("config", ("registry.guard_metrics", "registry.min_improvement_stderr",
                     "eval.harness.tasks", "eval.bootstrap_samples"), _guards,
          example={"registry.guard_metrics": [{"metric": "eval.perplexity"}]}),
    Refuse("config", "registry.max_contamination",
           _in("eval.contamination_ngram null", lambda c: c.eval.contamination_ngram is None),
           "the evaluate stage measures no contamination to gate on; set "
           "eval.contamination_ngram (13) or registry.max_contamination: null",
           used=lambda c: c.registry.max_contamination is not None, example={"registry.max_contamination": 0.01, "eval.contamination_ngram": None}),
    Agree("config", ("registry.gate_metric", "eval.generation_metrics"), _gate_computed,
          example={"registry.gate_metric": "eval.exact_match", "eval.generation_metrics": []}),
    *(row for task in MODEL_TASKS for row in _kind_rows(task)),
    Needs("config", "checkpoint.preserve_n_best", METRIC,
          "it keeps the best checkpoints by that metric",
          example={"checkpoint.preserve_n_best": 2}),
    Needs("config", "checkpoint.load_best_model_at_end", METRIC,
          "the best model is the best by that metric",
          example={"checkpoint.load_best_model_at_end": True}),
    Needs("config", "eval.early_stopping_patience", METRIC,
          "patience counts evaluations that do not improve that metric",
          used=lambda c: c.eval.early_stopping_patience is not None,
          example={"eval.early_stopping_patience": 3}),
    Needs("config", "checkpoint.metric_for_best_model", EVALUATING,
          "the metric is computed by evaluation",
          used=lambda c: c.checkpoint.metric_for_best_model is not None and (
              c.checkpoint.load_best_model_at_end or c.eval.early_stopping_patience is not None
              or c.checkpoint.preserve_n_best is not None),
          example={"checkpoint.metric_for_best_model": "eval_loss",
                   "eval.early_stopping_patience": 3, "eval.eval_strategy": "no"}),
    Agree("config", ("checkpoint.load_best_model_at_end", "checkpoint.save_strategy",
                     "eval.eval_strategy"), _best_model_cadence,
          example={"checkpoint.load_best_model_at_end": True,
                   "checkpoint.metric_for_best_model": "eval_loss",
                   "eval.eval_strategy": "epoch"}),
    Agree("config", ("eval.during_training_metrics", "training.type",
                     "eval.generation_metrics", "distributed.strategy"),
          _during_training_metrics,
          example={"eval.during_training_metrics": True, "eval.generation_metrics": []}),
    Agree("config", ("checkpoint.metric_for_best_model", "eval.during_training_metrics",
                     "eval.generation_metrics", "data.dataset_type"), _best_metric_reported,
          example={"checkpoint.metric_for_best_model": "eval_exact_match"}),
    Agree("config", ("eval.early_stopping_threshold_stderr", "checkpoint.metric_for_best_model",
                     "eval.bootstrap_samples"), _threshold_stderr,
          example={"eval.early_stopping_threshold_stderr": 1.0,
                   "checkpoint.metric_for_best_model": "eval_exact_match",
                   "eval.during_training_metrics": True, "eval.bootstrap_samples": 0}),
    Agree("config", ("checkpoint.resume_ignore_changes",), lambda c: _unknown_fingerprint_key(c),
          example={"checkpoint.resume_ignore_changes": ["training.no_such_key"]}),
    # the machine (checked where the device is known)
    Needs("machine", "training.mixed_precision", CUDA,
          "fp16 on CPU is about 100x slower than fp32 here; use bf16 or fp32",
          used=lambda m: m.cfg.training.mixed_precision == "fp16"),
    Needs("machine", "model.load_in_4bit", CUDA,
          "bitsandbytes quantised loading; set it to false to train in the model's dtype here"),
    Needs("machine", "model.load_in_8bit", CUDA,
          "bitsandbytes quantised loading; set it to false to train in the model's dtype here"),
    *(Needs("machine", key, CUDA, why, used=lambda m, key=key: _get(m, key)
            not in (None, False))
      for key, why in _CUDA_ONLY_WHY.items()),
    Needs("machine", "training.sdpa_backend", CUDA,
          f"only {' and '.join(CPU_SDPA)} run on a CPU",
          used=lambda m: any(n not in CPU_SDPA for n in m.cfg.training.sdpa_backend or ())),
    Needs("machine", "training.use_liger_kernel", CUDA,
          "Liger's kernels are Triton programs for CUDA GPUs; set it false here"),
    Needs("machine", "training.fp8_recipe", FP8_GPU,
          "fp8 matmuls; use mixed_precision: bf16 here"),
    Needs("machine", "distributed.backend", CUDA, "NCCL runs on GPUs; use gloo or auto",
          used=lambda m: m.cfg.distributed.backend == "nccl"),
]
