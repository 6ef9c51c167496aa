"""Trained models the params name (every key whose field is marked `model_ref`:
finetune.config.section.Field): checked before anything runs, and registered ones
(`models:/NAME@alias`, `models:/NAME/VERSION`) resolved to their files.

The engine loads a model from a folder; a registered model is this pipeline's MLflow
registry's, so the stages that load one (train, evaluate) resolve it here first: the alias to
its version, the version's files downloaded once to `data/<role>s/v<version>/<name>` (a
reward model: `data/reward_models/v3/scorer`; a version's files never change), and the entry
replaced by that path in the config the stage runs with. The resolved path is what the
checkpoint fingerprint sees: a resume after the alias moved to another version is another
run's checkpoint, not this one's.

Nothing here names a key or a method: the references are found by their fields' mark
(finetune.config.model_refs.model_refs, which also leaves out a method's own section in another
method's run), and what a folder must hold is its role's check, the engine's own
(engine.preflight.MODEL_FOLDER_CHECKS).
"""

from __future__ import annotations

from pathlib import Path

from finetune.config.model_refs import REGISTERED_MODEL, ModelRef, model_refs, replaced
from finetune.errors import PipelineError
from finetune.files import atomic_dir
from finetune.workspace import Workspace


def _check_folder(role: str, root: Path, ref: str, entry: str) -> Path:
    """The engine's check of a folder for `role` (engine.preflight: the door the stages'
    checks go through; torch is imported only when a run names such a model)."""
    from engine.preflight import check_model_folder

    return check_model_folder(role, root, ref, entry)


def downloads(role: str) -> Path:
    """Where registered models of `role` are downloaded, under the project root."""
    return Path("data") / f"{role}s"


def _version(ws: Workspace, ref: ModelRef) -> tuple[str, str]:
    """(name, version) a registered model's URI names now."""
    from mlflow.exceptions import MlflowException

    from tasks import tracking

    key, words = ref.entry, ref.role.replace("_", " ")
    match = REGISTERED_MODEL.fullmatch(ref.ref)
    name = match["name"]
    uri = ws.mlflow_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        # no store yet: nothing is registered (and asking would create the database)
        raise PipelineError(f"{key} '{ref.ref}': not in the model registry at {uri} (there "
                            f"is no MLflow database yet: register the {words} first)")
    try:
        client = tracking.client(ws)
        if match["alias"]:
            return name, str(client.get_model_version_by_alias(name, match["alias"]).version)
        return name, str(client.get_model_version(name, match["version"]).version)
    except MlflowException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"{key} '{ref.ref}': not in the model registry at {uri} "
                            f"({first})") from None


def check(ws: Workspace) -> None:
    """`finetune validate`: every model folder holds what its key needs (its role's check),
    and every registered model exists (nothing is downloaded)."""
    for ref in model_refs(ws.config):
        if ref.kind == "folder":
            _check_folder(ref.role, ws.root, ref.ref, ref.entry)
        else:
            _version(ws, ref)


def resolved(ws: Workspace) -> Workspace:
    """`ws` with each registered model replaced by its downloaded folder (relative to the
    project root), every model folder checked; `ws` itself when the params name none."""
    refs = model_refs(ws.config)
    if not refs:
        return ws
    local_refs: dict[ModelRef, str] = {}
    for ref in refs:
        folder = ref.ref
        if ref.kind == "registered":
            name, version = _version(ws, ref)
            local = downloads(ref.role) / f"v{version}" / name  # its name: the metrics'
            if not (ws.root / local).is_dir():
                _download(ws, f"models:/{name}/{version}", ws.root / local)
            print(f"[{ref.role}] {ref.entry} '{ref.ref}': version {version}, files in {local}",
                  flush=True)
            folder = local_refs[ref] = local.as_posix()
        _check_folder(ref.role, ws.root, folder, ref.entry)
    return Workspace(config=replaced(ws.config, local_refs), root=ws.root,
                     params_path=ws.params_path)


def _download(ws: Workspace, uri: str, dest: Path) -> None:
    import mlflow

    from tasks.registry import use_tracking_uri

    with use_tracking_uri(ws.mlflow_uri()), atomic_dir(dest) as staging:
        mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging))
