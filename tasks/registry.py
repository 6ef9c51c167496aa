"""MLflow Model Registry: log the export with the transformers flavour, register it, gate it.

Every export becomes a new registered version with the `candidate` alias. It takes the
`champion` alias (the one serving reads, `models:/<name>@champion`) only when there is no
champion yet or when its gate metric beats the champion's by `registry.min_improvement`. The
nightly retrain therefore never replaces a better model with a worse one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from importlib.metadata import version as installed_version
from typing import Any

from finetune.config.outputs import RegistryConfig
from finetune.errors import PipelineError

# What the pyfunc needs to load and run a merged causal LM; pinned to what trained it.
# Explicit on purpose: MLflow's inference of requirements imports torchvision and fails.
SERVING_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


def pip_requirements() -> list[str]:
    return [f"{name}=={installed_version(name)}" for name in SERVING_PACKAGES]


def gate_tag(metric: str) -> str:
    return f"gate.{metric}"


@dataclass
class Decision:
    """What the gate did, recorded in data/lineage/model_version.json and the flow summary."""

    name: str
    version: str
    promoted: bool
    reason: str
    gate_metric: str
    value: float | None
    champion_version: str | None = None
    champion_value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"registered": True, **asdict(self)}


def _by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _metric_of(client, mv, metric: str) -> float | None:
    """The champion's gate value: its version tag, else its run's metric (older versions)."""
    tagged = mv.tags.get(gate_tag(metric))
    if tagged is not None:
        return float(tagged)
    if mv.run_id:
        return client.get_run(mv.run_id).data.metrics.get(metric)
    return None


def promote(client, name: str, version: str, value: float | None,
            cfg: RegistryConfig) -> Decision:
    """Alias the new version as candidate; make it champion if it wins the gate. Without a
    value (no evaluation ran) it stays a candidate: nothing unmeasured goes into service."""
    metric = cfg.gate_metric
    client.set_registered_model_alias(name, cfg.candidate_alias, version)
    decision = Decision(name, str(version), False, "", metric, value)
    champion = _by_alias(client, name, cfg.champion_alias)
    if value is None:
        decision.reason = (f"no {metric} for this model (run the evaluate stage first); "
                           "kept as candidate")
        decision.champion_version = str(champion.version) if champion else None
        return decision
    client.set_model_version_tag(name, version, gate_tag(metric), repr(float(value)))
    if champion is None:
        decision.promoted, decision.reason = True, "first model: no champion yet"
    else:
        decision.champion_version = str(champion.version)
        champ = _metric_of(client, champion, metric)
        decision.champion_value = champ
        if champ is None:
            decision.reason = (f"champion v{champion.version} has no {metric}; kept it (move the "
                               f"'{cfg.champion_alias}' alias by hand to override)")
        else:
            gain = value - champ if cfg.higher_wins else champ - value
            direction = "higher" if cfg.higher_wins else "lower"
            decision.promoted = gain > 0 and gain >= cfg.min_improvement
            verdict = "beats" if decision.promoted else "does not beat"
            decision.reason = (f"{metric} {value:.6g} {verdict} champion v{champion.version}'s "
                               f"{champ:.6g} ({direction} is better, improvement {gain:+.6g}, "
                               f"minimum {cfg.min_improvement:g})")
    if decision.promoted:
        client.set_registered_model_alias(name, cfg.champion_alias, version)
    return decision


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
                     max_new_tokens: int, card: str, pipeline_tag: str = "text-generation"
                     ) -> str:
    """Log `model` (a merged transformers model) into the run and register it; the version.

    `card` (our model card) is passed so MLflow does not try to fetch one from the Hub.
    `pipeline_tag`: the transformers pipeline it serves as (the dataset type's model task); a
    text-classification pipeline gets MLflow's default signature for it (text in, label and
    score out)."""
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
        info = mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer},
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


def tag_version(client, name: str, version: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))
