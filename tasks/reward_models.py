"""Reward models named in `grpo.reward_funcs`: checked before anything runs, and registered
ones (`models:/name@alias`, `models:/name/version`) resolved to their files.

The engine scores with a reward model directory (engine.rollout.reward_model); a
registered model is this pipeline's MLflow registry's, so the stages that score (train,
evaluate) resolve it here first: the alias to its version, the version's files downloaded once
to `data/reward_models/v<version>/<name>` (a version's files never change), and the entry
replaced by that path in the config the stage runs with. The resolved path is what the
checkpoint fingerprint sees: a resume after the alias moved to another version is another
run's checkpoint, not this one's.
"""

from __future__ import annotations

from pathlib import Path

from finetune.config.model_refs import REGISTERED_MODEL
from finetune.config.reward_refs import reward_kind
from finetune.errors import PipelineError
from finetune.files import atomic_dir
from finetune.workspace import Workspace

#: where registered reward models' files are downloaded, under the project root
DOWNLOADS = Path("data/reward_models")


def _entries(ws: Workspace) -> list[tuple[str, str]]:
    cfg = ws.config
    if cfg.training.type != "grpo":
        return []
    return [(f"grpo.reward_funcs[{i}]", ref) for i, ref in cfg.grpo.reward_models]


def _version(ws: Workspace, key: str, ref: str) -> tuple[str, str]:
    """(name, version) a registered model's URI names now."""
    from mlflow.exceptions import MlflowException

    from tasks import tracking

    match = REGISTERED_MODEL.fullmatch(ref)
    name = match["name"]
    uri = ws.mlflow_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        # no store yet: nothing is registered (and asking would create the database)
        raise PipelineError(f"{key} '{ref}': not in the model registry at {uri} (there is "
                            "no MLflow database yet: register the reward model first)")
    try:
        client = tracking.client(ws)
        if match["alias"]:
            return name, str(client.get_model_version_by_alias(name, match["alias"]).version)
        return name, str(client.get_model_version(name, match["version"]).version)
    except MlflowException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"{key} '{ref}': not in the model registry at {uri} "
                            f"({first})") from None


def check(ws: Workspace) -> None:
    """`finetune validate`: every reward model directory is a one-output sequence classifier
    with its tokenizer, and every registered one exists (nothing is downloaded)."""
    from engine.rollout.reward_model import check_reward_model

    for key, ref in _entries(ws):
        if reward_kind(ref) == "directory":
            check_reward_model(ws.root, ref, key)
        else:
            _version(ws, key, ref)


def resolved(ws: Workspace) -> Workspace:
    """`ws` with each registered reward model replaced by its downloaded directory (relative
    to the project root), every reward model checked; `ws` itself when there is none."""
    from engine.rollout.reward_model import check_reward_model

    entries = _entries(ws)
    if not entries:
        return ws
    refs = list(ws.config.grpo.reward_funcs)
    for key, ref in entries:
        if reward_kind(ref) == "registered":
            name, version = _version(ws, key, ref)
            local = DOWNLOADS / f"v{version}" / name  # its name: the metrics'
            if not (ws.root / local).is_dir():
                _download(ws, f"models:/{name}/{version}", ws.root / local)
            print(f"[reward] {key} '{ref}': version {version}, files in {local}", flush=True)
            refs[int(key.split("[")[1].rstrip("]"))] = local.as_posix()
            ref = local.as_posix()
        check_reward_model(ws.root, ref, key)
    cfg = ws.config.model_copy(deep=True)
    cfg.grpo.reward_funcs = refs
    return Workspace(config=cfg, root=ws.root, params_path=ws.params_path)


def _download(ws: Workspace, uri: str, dest: Path) -> None:
    import mlflow

    from tasks.registry import use_tracking_uri

    with use_tracking_uri(ws.mlflow_uri()), atomic_dir(dest) as staging:
        mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging))
