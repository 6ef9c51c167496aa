"""MLflow Model Registry: log the export with the transformers flavour, register it, gate it.

Every export becomes a new registered version with the `candidate` alias. It takes the
`champion` alias (the one serving reads, `models:/<name>@champion`) only when there is no
champion yet or when its gate metric beats the champion's by `registry.min_improvement`. The
nightly retrain therefore never replaces a better model with a worse one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

from finetune.config.registry import RegistryConfig, stderr_key
from finetune.errors import PipelineError
from finetune.files import file_sha256
from tasks import gate

# What the pyfunc needs to load and run a merged causal LM; pinned to what trained it.
# Explicit on purpose: MLflow's inference of requirements imports torchvision and fails.
SERVING_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


def pip_requirements() -> list[str]:
    return [f"{name}=={installed_version(name)}" for name in SERVING_PACKAGES]


def gate_tag(metric: str) -> str:
    return f"gate.{metric}"


#: registered-model tag: the versions that were champion, oldest first (rollback's "previous")
HISTORY_TAG = "champion_history"


@dataclass
class Decision:
    """What the gate did, recorded in data/lineage/model_version.json, the flow summary, the
    version's tags (gate.decision, gate.guard.METRIC) and its run's gate/decision.json."""

    name: str
    version: str
    promoted: bool
    reason: str
    gate_metric: str
    value: float | None
    champion_version: str | None = None
    champion_value: float | None = None
    table: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"registered": True, **asdict(self)}

    def markdown(self) -> str:
        """The decision table (tasks.gate.markdown) under a line with the decision."""
        rows = [gate.Row(**row) for row in self.table]
        verdict = "promoted" if self.promoted else "not promoted"
        return gate.markdown(rows, f"{self.name} v{self.version}: {verdict} ({self.reason})")


def _by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _metric_of(client, mv, metric: str) -> float | None:
    """A version's value of `metric`: its version tag, else its run's metric (older versions)."""
    tagged = mv.tags.get(gate_tag(metric))
    if tagged is not None:
        return float(tagged)
    if mv.run_id:
        return client.get_run(mv.run_id).data.metrics.get(metric)
    return None


def _gated_metrics(cfg: RegistryConfig) -> list[str]:
    """The metrics the gate reads, with their standard errors' keys."""
    names = [cfg.gate_metric, *(g.metric for g in cfg.guard_metrics)]
    return [key for name in names for key in (name, stderr_key(name))]


def promote(client, name: str, version: str, value: float | None,
            cfg: RegistryConfig, metrics: dict[str, float] | None = None) -> Decision:
    """Alias the new version as candidate; make it champion if it wins the gate. Without a
    value (no evaluation ran) it stays a candidate: nothing unmeasured goes into service.

    `metrics`: the candidate's other metrics (eval.* keys as MLflow has them), for the guards
    and the standard errors; each one the gate reads is tagged gate.<key> on the version, so a
    later candidate compares against exactly these numbers."""
    metric = cfg.gate_metric
    client.set_registered_model_alias(name, cfg.candidate_alias, version)
    decision = Decision(name, str(version), False, "", metric, value)
    champion = _by_alias(client, name, cfg.champion_alias)
    if value is None:
        decision.reason = (f"no {metric} for this model (run the evaluate stage first); "
                           "kept as candidate")
        decision.champion_version = str(champion.version) if champion else None
        return decision
    candidate = _candidate_values(cfg, value, metrics or {})
    for key, number in candidate.items():
        client.set_model_version_tag(name, version, gate_tag(key), repr(number))
    if champion is None:
        _judge_first(decision, cfg, candidate)
    else:
        _judge_against(decision, cfg, candidate, champion, client)
    if decision.promoted:
        _crown(client, name, version, cfg, champion)
    _record(client, name, version, decision, cfg)
    return decision


def _candidate_values(cfg: RegistryConfig, value: float,
                      metrics: dict[str, float]) -> dict[str, float]:
    """The candidate's numbers the gate reads: its gate metric, guards, their standard errors
    and, when contamination is gated, its contamination metrics."""
    candidate = {k: float(v) for k, v in metrics.items()
                 if k in _gated_metrics(cfg)
                 or (cfg.max_contamination is not None and gate.is_contamination(k))}
    candidate[cfg.gate_metric] = float(value)
    return candidate


def _judge_first(decision: Decision, cfg: RegistryConfig, candidate: dict[str, float]) -> None:
    """No champion yet: the first model takes the alias unless contamination refuses it."""
    rows = gate.judge(cfg, {}, candidate)
    contaminated = [r for r in rows if r.role == "contamination" and r.verdict != gate.PASS]
    decision.promoted = not contaminated
    decision.reason = "first model: no champion yet" + "".join(
        f"; refused: {r.metric} ({r.why})" for r in contaminated)
    decision.table = [r.as_dict() for r in rows]
    for row in decision.table:
        if row["role"] != "contamination":
            row["verdict"], row["why"] = "first model", ""


def _judge_against(decision: Decision, cfg: RegistryConfig, candidate: dict[str, float],
                   champion, client) -> None:
    """The candidate against the champion's recorded numbers: it must beat the gate metric by
    the minimum improvement and pass every guard and contamination row."""
    metric, value = cfg.gate_metric, candidate[cfg.gate_metric]
    decision.champion_version = str(champion.version)
    champ_values = {key: v for key in _gated_metrics(cfg)
                    if (v := _metric_of(client, champion, key)) is not None}
    champ = decision.champion_value = champ_values.get(metric)
    rows = gate.judge(cfg, champ_values, candidate)
    decision.table = [r.as_dict() for r in rows]
    if champ is None:
        decision.reason = (f"champion v{champion.version} has no {metric}; kept it (move the "
                           f"'{cfg.champion_alias}' alias by hand to override)")
        return
    gain = value - champ if cfg.higher_wins else champ - value
    direction = "higher" if cfg.higher_wins else "lower"
    beats = rows[0].verdict == gate.PASS
    failed = [r for r in rows[1:] if r.verdict != gate.PASS]
    decision.promoted = beats and not failed
    verdict = "beats" if beats else "does not beat"
    minimum = (f"{cfg.min_improvement:g}" if not cfg.min_improvement_stderr
               else f"{rows[0].allowed}{'; ' + rows[0].why if rows[0].why else ''}")
    decision.reason = (f"{metric} {value:.6g} {verdict} champion v{champion.version}'s "
                       f"{champ:.6g} ({direction} is better, improvement {gain:+.6g}, "
                       f"minimum {minimum})")
    guards = [r for r in failed if r.role == "guard"]
    if guards:
        decision.reason += "; guard failed: " + ", ".join(f"{r.metric} ({r.why})" for r in guards)
    decision.reason += "".join(f"; refused: {r.metric} ({r.why})"
                               for r in failed if r.role == "contamination")


def _crown(client, name: str, version: str, cfg: RegistryConfig, champion) -> None:
    """Move the champion alias to `version` and append it to the champion history (the
    registered model's tag; a model that had a champion before the history existed starts
    it with that champion)."""
    history = champion_history(client, name)
    if champion is not None and (not history or history[-1] != str(champion.version)):
        history.append(str(champion.version))
    history.append(str(version))
    client.set_registered_model_alias(name, cfg.champion_alias, version)
    client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history))


def champion_history(client, name: str) -> list[str]:
    tag = client.get_registered_model(name).tags.get(HISTORY_TAG, "")
    return [v for v in tag.split(",") if v]


def _record(client, name: str, version: str, decision: Decision, cfg: RegistryConfig) -> None:
    """The decision as version tags and, on the version's run, gate/decision.json and
    gate/decision.md (the table)."""
    word = "promoted" if decision.promoted else "not promoted"
    client.set_model_version_tag(name, version, "gate.decision", word)
    for row in decision.table:
        if row["role"] == "guard":
            client.set_model_version_tag(name, version, f"gate.guard.{row['metric']}",
                                         row["verdict"])
    run_id = client.get_model_version(name, version).run_id
    if run_id:
        client.log_dict(run_id, decision.as_dict(), "gate/decision.json")
        client.log_text(run_id, decision.markdown(), "gate/decision.md")


def rollback(client, name: str, cfg: RegistryConfig, reason: str) -> str:
    """Move the champion alias back to the previous champion (the champion history's entry
    before the current champion), tag both versions with why, and say what moved."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        raise PipelineError(f"no registered model '{name}' in {client.tracking_uri}") from None
    champion = _by_alias(client, name, cfg.champion_alias)
    if champion is None:
        raise PipelineError(f"'{name}' has no '{cfg.champion_alias}' alias: nothing to roll back")
    history = champion_history(client, name)
    current = str(champion.version)
    while history and history[-1] != current:  # moved by hand since: that one is current
        history.pop()
    if len(history) < 2:
        raise PipelineError(f"'{name}' has no previous champion before v{current} "
                            f"(champion history: {','.join(history) or 'none'})")
    history.pop()
    previous = history[-1]
    client.set_registered_model_alias(name, cfg.champion_alias, previous)
    client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history))
    client.set_model_version_tag(name, current, "rollback.reason", reason)
    client.set_model_version_tag(name, previous, "rollback.restored_from", current)
    client.set_registered_model_tag(name, "last_rollback", f"v{current} -> v{previous}: {reason}")
    return f"{name}: '{cfg.champion_alias}' moved from v{current} back to v{previous} ({reason})"


@contextlib.contextmanager
def use_tracking_uri(uri: str):
    """MLflow's fluent API (log_model, models:/ URIs) reads a process-global tracking URI, and
    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI to every later subprocess: set it
    for this block only."""
    import mlflow

    env_before, before = os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before


def log_and_register(tracking_uri: str, run_id: str, model, tokenizer, name: str,
                     max_new_tokens: int, card: str, pipeline_tag: str = "text-generation",
                     processor=None) -> str:
    """Log `model` (a merged transformers model) into the run and register it; the version.

    `card` (our model card) is passed so MLflow does not try to fetch one from the Hub.
    `pipeline_tag`: the transformers pipeline it serves as (the dataset type's model task); a
    text-classification pipeline gets MLflow's default signature for it (text in, label and
    score out). `processor`: a vision-language model's (an image-text-to-text pipeline needs
    one, and MLflow's component keys have none: the pipeline is built here and logged, its
    tokenizer and image processor as MLflow's components)."""
    import mlflow
    from huggingface_hub import ModelCard
    from mlflow.models import infer_signature

    task = pipeline_tag
    if task != "text-generation":
        signature, model_config = None, None
    else:
        signature = infer_signature(["prompt"], ["generated text"],
                                    params={"max_new_tokens": max_new_tokens})
        model_config = {"max_new_tokens": max_new_tokens, "do_sample": False}
    with use_tracking_uri(tracking_uri), mlflow.start_run(run_id=run_id):
        if processor is not None:
            from transformers import pipeline

            components = pipeline(task, model=model, processor=processor)
        else:
            components = {"model": model, "tokenizer": tokenizer}
        info = mlflow.transformers.log_model(
            components,
            name="model",
            task=task,
            signature=signature,
            model_config=model_config,
            pip_requirements=pip_requirements(),
            model_card=ModelCard(card),
            registered_model_name=name,
        )
    if info.registered_model_version is None:
        raise PipelineError(f"MLflow did not register a version of '{name}' ({tracking_uri})")
    return str(info.registered_model_version)


#: version tag prefix: `weights_sha256.<file>` for each weight file of the export folder (the
#: merged model the version holds, the adapter, GGUF and quantized files), so that
#: `finetune reproduce` can check a rebuild byte for byte
WEIGHTS_TAG = "weights_sha256."
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pt", ".bin")


def weight_hashes(folder: Path) -> dict[str, str]:
    """Each weight file under `folder` (relative POSIX path) -> its sha256."""
    return {path.relative_to(folder).as_posix(): file_sha256(path)
            for path in sorted(folder.rglob("*"))
            if path.is_file() and path.suffix in WEIGHT_SUFFIXES}


def weight_tags(folder: Path) -> dict[str, str]:
    return {f"{WEIGHTS_TAG}{rel}": sha for rel, sha in weight_hashes(folder).items()}


def tag_version(client, name: str, version: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))
