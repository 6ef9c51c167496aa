"""`finetune publish models:/NAME@alias --to DEST`: a version the gate promoted, its files and a
model card with its lineage and the gate's decision, uploaded to a folder, an fsspec URL
(`s3://`, `memory://`, `file://`) or a Hugging Face Hub repo (`hf://OWNER/NAME`, through
`huggingface_hub`, honouring HF_ENDPOINT and HF_TOKEN).

Which versions: the gate records its decision as the version's `gate.decision` tag
(tasks.registry._record: `promoted` or `not promoted`); any other version is refused unless
`force`. Which files: the export folder (`data/export`: the merged model, the adapter, the GGUF
files and Modelfile when the params wrote them) when its weight files' sha256 equal the
version's `weights_sha256.*` tags, else the version's own files from the MLflow store (the
merged model and its tokenizer, `registered_folder`). Idempotent: each file's remote hash is
read first and only files whose bytes differ are uploaded (a Hub repo: one commit, or none);
after the upload each uploaded file's remote hash is read back and checked.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune.config.model_refs import REGISTERED_MODEL
from finetune.errors import PipelineError
from finetune.files import atomic_dir, file_sha256
from finetune.workspace import Workspace
from tasks import tracking

#: the version tag the gate writes (tasks.registry._record)
DECISION_TAG = "gate.decision"
PROMOTED = "promoted"


@dataclass
class Version:
    """A registered version as publish and serve read it."""

    name: str
    version: str
    run_id: str | None
    tags: dict[str, str]

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    @property
    def promoted(self) -> bool:
        return self.tags.get(DECISION_TAG) == PROMOTED


def registered_version(ws: Workspace, uri: str, what: str = "MODEL_URI") -> Version:
    """The version `uri` (models:/NAME@alias or models:/NAME/VERSION) names now; one line
    naming it when the URI is malformed or the registry does not hold it."""
    from mlflow.exceptions import MlflowException

    match = REGISTERED_MODEL.fullmatch(uri)
    if not match:
        raise PipelineError(f"{what} '{uri}': expected models:/NAME@ALIAS or "
                            "models:/NAME/VERSION")
    store = ws.mlflow_uri()
    if store.startswith("sqlite:///") and not Path(store.removeprefix("sqlite:///")).exists():
        raise PipelineError(f"{what} '{uri}': not in the model registry at {store} (there is "
                            "no MLflow database yet: run the pipeline first)")
    client = tracking.client(ws)
    try:
        if match["alias"]:
            mv = client.get_model_version_by_alias(match["name"], match["alias"])
        else:
            mv = client.get_model_version(match["name"], match["version"])
    except MlflowException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"{what} '{uri}': not in the model registry at {store} "
                            f"({first})") from None
    return Version(mv.name, str(mv.version), mv.run_id, dict(mv.tags))


def _weights_tags(version: Version) -> dict[str, str]:
    from tasks.registry import WEIGHTS_TAG

    return {k.removeprefix(WEIGHTS_TAG): v for k, v in version.tags.items()
            if k.startswith(WEIGHTS_TAG)}


def export_matches(ws: Workspace, version: Version) -> bool:
    """Whether the workspace's export folder holds this version's files (its weight files'
    sha256 equal the version's weights_sha256.* tags)."""
    from tasks.registry import weight_hashes

    tagged = _weights_tags(version)
    return bool(tagged) and ws.layout.export.is_dir() and weight_hashes(ws.layout.export) == tagged


def registered_folder(ws: Workspace, version: Version) -> Path:
    """The version's merged model from the MLflow store as one from_pretrained folder (MLflow's
    transformers flavour keeps the weights in `model/` and the tokenizer in
    `components/tokenizer/`), downloaded once to data/registered/v<version>/<name>."""
    import mlflow

    from tasks.registry import use_tracking_uri

    dest = ws.root / "data" / "registered" / f"v{version.version}" / version.name
    if not dest.is_dir():
        with use_tracking_uri(ws.mlflow_uri()), atomic_dir(dest) as staging:
            raw = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.uri,
                                                           dst_path=str(staging / ".mlflow")))
            for part in (raw / "model", raw / "components" / "tokenizer"):
                if part.is_dir():
                    shutil.copytree(part, staging, dirs_exist_ok=True)
            shutil.rmtree(staging / ".mlflow")
            if not (staging / "config.json").exists():
                raise PipelineError(f"{version.uri}: its MLflow files hold no model/config.json "
                                    "(not a transformers model this pipeline registered)")
    return dest


def version_folder(ws: Workspace, version: Version) -> tuple[Path, str]:
    """(the folder with the version's files, where they came from)."""
    if export_matches(ws, version):
        return ws.layout.export, f"{ws.layout.export.relative_to(ws.root)} (its weights' " \
                                 "sha256 equal the version's tags)"
    folder = registered_folder(ws, version)
    return folder, f"{folder.relative_to(ws.root)} (from the MLflow store)"


# -- the model card ------------------------------------------------------------------------------

def _run_artifacts(ws: Workspace, run_id: str | None) -> tuple[dict, dict, str]:
    """The run's lineage.json, gate/decision.json and gate/decision.md (empty when absent)."""
    if not run_id:
        return {}, {}, ""
    import mlflow

    from tasks.registry import use_tracking_uri

    base = tracking.client(ws).get_run(run_id).info.artifact_uri
    out: list = []
    with use_tracking_uri(ws.mlflow_uri()):
        for name, load in (("lineage.json", mlflow.artifacts.load_dict),
                           ("gate/decision.json", mlflow.artifacts.load_dict),
                           ("gate/decision.md", mlflow.artifacts.load_text)):
            try:
                out.append(load(f"{base}/{name}"))
            except Exception:  # noqa: BLE001 - an older run without it: the card says so
                out.append({} if name.endswith(".json") else "")
    return out[0], out[1], out[2]


#: a Hub model id, what the Hub accepts as a card's base_model
HUB_ID = re.compile(r"[\w\-.]+(/[\w\-.]+)?")


def _front_matter(card: str) -> tuple[str, str]:
    """(the YAML front matter block with its '---' lines, the rest) of a model card; a
    base_model that is no Hub id (a local folder: the Hub refuses the card) is left out of
    the metadata (the card's text names it)."""
    import yaml

    if card.startswith("---\n"):
        end = card.find("\n---\n", 4)
        if end != -1:
            meta = yaml.safe_load(card[4:end]) or {}
            base = meta.get("base_model")
            if isinstance(base, str) and not HUB_ID.fullmatch(base):
                meta.pop("base_model")
            head = f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n" if meta else ""
            return head, card[end + 5:]
    return "", card


def model_card(ws: Workspace, version: Version, files: dict[str, str], forced: bool,
               export_card: str) -> str:
    """README.md: the version, the gate's decision and table, the lineage as recorded (run id,
    params hash, data hashes, git revision), the files' sha256, then the export's own card."""
    lineage, decision, table = _run_artifacts(ws, version.run_id)
    front, body = _front_matter(export_card)
    gate_word = version.tags.get(DECISION_TAG, "no decision recorded")
    # the run's gate/decision.* are its last export's: another version's after a re-export
    if str(decision.get("version")) == version.version and decision.get("reason"):
        said = [f"{gate_word}: {decision['reason']}", "", *([table.strip(), ""] if table else [])]
    else:
        said = [f"{gate_word} (the version's {DECISION_TAG} tag; its run's gate/decision.json "
                "records another version's decision)", ""]
    lines = [f"# {version.name} v{version.version}", "",
             f"Published from `{version.uri}` by `finetune publish`"
             + (" with --force: the gate did not promote this version." if forced else "."), "",
             "## Gate decision", "", *said]
    recorded = {"MLflow run id": version.run_id or "-",
                "params hash (config_fingerprint)": lineage.get("config_fingerprint", "-"),
                "params file": lineage.get("params_file", "-"),
                "git commit": lineage.get("git_commit", version.tags.get("git_commit", "-")),
                "git dirty": lineage.get("git_dirty", "-")}
    recorded.update({k: v for k, v in sorted(lineage.items()) if k.startswith("data_sha256")})
    lines += ["## Lineage", "", "| entry | value |", "|---|---|",
              *(f"| {k} | {v} |" for k, v in recorded.items()), "",
              "## Files", "", "| file | sha256 |", "|---|---|",
              *(f"| {rel} | {sha} |" for rel, sha in sorted(files.items())), ""]
    text = "\n".join(lines)
    if body.strip():
        text += "\n## Export model card\n\n" + body.lstrip()
    return front + text


# -- destinations --------------------------------------------------------------------------------

def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Local:
    """One file to publish: its bytes' source and hashes."""

    rel: str
    path: Path | None
    data: bytes | None
    sha256: str

    def read(self) -> bytes:
        return self.data if self.data is not None else self.path.read_bytes()

    def git_sha1(self) -> str:
        return _git_blob_sha1(self.read())


class FsspecDest:
    """A folder or any fsspec URL: a file's remote hash is its bytes' sha256 read back."""

    def __init__(self, url: str):
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            raise PipelineError(f"--to {url}: the {scheme}:// filesystem needs a package that "
                                f"is not installed ({str(exc).splitlines()[0]}); e.g. "
                                f"`pip install s3fs` for s3://") from None
        except ValueError as exc:
            raise PipelineError(f"--to {url}: {exc}") from None
        self.url = url

    def _path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def matches(self, local: Local) -> bool:
        path = self._path(local.rel)
        if not self.fs.exists(path) or self.fs.isdir(path):
            return False
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() == local.sha256

    def upload(self, changed: list[Local], message: str) -> str:
        for local in changed:
            path = self._path(local.rel)
            parent = path.rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            with self.fs.open(path, "wb") as fh:
                if local.data is not None:
                    fh.write(local.data)
                else:
                    with open(local.path, "rb") as src:
                        shutil.copyfileobj(src, fh, 1 << 20)
        return f"{len(changed)} file(s) written under {self.url}"


class HubDest:
    """A Hugging Face Hub model repo, through huggingface_hub (HF_ENDPOINT, HF_TOKEN): a file's
    remote hash is its LFS sha256, or its git blob id for a file stored in git."""

    def __init__(self, repo_id: str, target: str):
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise PipelineError(f"--to {target}: HF_HUB_OFFLINE is set (the Makefile sets it); "
                                "run with HF_HUB_OFFLINE=0 to publish to the Hub")
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise PipelineError(f"--to {target}: expected hf://OWNER/NAME")
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
        self.repo_id, self.target = repo_id, target
        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None,
                         token=os.environ.get("HF_TOKEN") or None)
        self._remote: dict | None = None

    def _call(self, what: str, fn, *args, **kwargs):
        from huggingface_hub.errors import HfHubHTTPError

        try:
            return fn(*args, **kwargs)
        except HfHubHTTPError as exc:
            first = str(exc).strip().splitlines()[0]
            raise PipelineError(f"--to {self.target}: {what} failed at {self.api.endpoint} "
                                f"({first})") from None
        except ValueError as exc:  # the Hub's word on the card's metadata
            said = " ".join(str(exc).split())
            raise PipelineError(f"--to {self.target}: {what} refused by "
                                f"{self.api.endpoint}: {said}") from None
        except OSError as exc:  # connection refused, DNS
            raise PipelineError(f"--to {self.target}: {what} failed: cannot reach "
                                f"{self.api.endpoint} ({exc})") from None

    def remote(self, paths: list[str]) -> dict:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            infos = self._call("reading the repo's files", self.api.get_paths_info,
                               self.repo_id, paths, repo_type="model")
        except PipelineError as exc:
            if isinstance(exc.__context__, (RepositoryNotFoundError, RevisionNotFoundError)):
                return {}
            raise
        return {i.path: i for i in infos if hasattr(i, "blob_id")}

    def matches_all(self, locals_: list[Local]) -> dict[str, bool]:
        found = self.remote([f.rel for f in locals_])
        out = {}
        for f in locals_:
            info = found.get(f.rel)
            if info is None:
                out[f.rel] = False
            elif info.lfs is not None:
                out[f.rel] = info.lfs.sha256 == f.sha256
            else:
                out[f.rel] = info.blob_id == f.git_sha1()
        return out

    def upload(self, changed: list[Local], message: str) -> str:
        from huggingface_hub import CommitOperationAdd

        self._call("creating the repo", self.api.create_repo, self.repo_id, repo_type="model",
                   exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=f.rel,
                                  path_or_fileobj=f.data if f.data is not None else str(f.path))
               for f in changed]
        info = self._call("the commit", self.api.create_commit, self.repo_id, ops,
                          commit_message=message, repo_type="model")
        return f"commit {info.oid[:12]} to {self.repo_id} at {self.api.endpoint}"


def destination(to: str):
    if to.startswith("hf://"):
        return HubDest(to.removeprefix("hf://").strip("/"), to)
    if to.startswith("hf:"):
        return HubDest(to.removeprefix("hf:").strip("/"), to)
    return FsspecDest(to)


def _matches(dest, files: list[Local]) -> dict[str, bool]:
    if isinstance(dest, HubDest):
        return dest.matches_all(files)
    return {f.rel: dest.matches(f) for f in files}


# -- the command ---------------------------------------------------------------------------------

def publish(ws: Workspace, uri: str, to: str, force: bool = False) -> list[str]:
    """Publish `uri` to `to`; the lines to print. Refuses a version the gate did not promote
    (unless `force`) before anything is read or written."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    version = registered_version(ws, uri)
    lines = []
    if not version.promoted:
        said = version.tags.get(DECISION_TAG, "no decision recorded")
        if not force:
            named = version.uri if uri == version.uri else f"{uri} ({version.uri})"
            raise PipelineError(f"{named}: the gate did not promote this version "
                                f"({DECISION_TAG}: {said}); publish the champion, or pass "
                                "--force")
        lines.append(f"warning: publishing {version.uri} although the gate did not promote it "
                     f"({DECISION_TAG}: {said}; --force)")
    dest = destination(to)
    folder, source = version_folder(ws, version)
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
             if p.is_file() and p.relative_to(folder).as_posix() != "README.md"}
    hashes = {rel: file_sha256(p) for rel, p in files.items()}
    export_card = (folder / "README.md").read_text() if (folder / "README.md").exists() else ""
    card = model_card(ws, version, hashes, not version.promoted, export_card).encode()
    local = [Local(rel, p, None, hashes[rel]) for rel, p in files.items()]
    local.append(Local("README.md", None, card, hashlib.sha256(card).hexdigest()))
    lines.append(f"{version.uri}: {len(local)} files from {source}")
    same = _matches(dest, local)
    changed = [f for f in local if not same[f.rel]]
    if not changed:
        lines.append(f"nothing to upload: {to} already holds the same bytes of all "
                     f"{len(local)} files")
        return lines
    lines.append(dest.upload(changed, f"{version.uri} (finetune publish)"))
    after = _matches(dest, changed)
    bad = [f.rel for f in changed if not after[f.rel]]
    if bad:
        raise PipelineError(f"--to {to}: after the upload {', '.join(bad)} do not have the "
                            "uploaded bytes' hash there; nothing else was changed by us since")
    size = sum(len(f.data) if f.data is not None else f.path.stat().st_size for f in changed)
    lines.append(f"uploaded {len(changed)} of {len(local)} files ({size:,} bytes), each "
                 "one's hash checked after the upload: "
                 + ", ".join(f.rel for f in changed[:6]) + (" ..." if len(changed) > 6 else ""))
    return lines
