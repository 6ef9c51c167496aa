"""The `finetune/default` deployment and its nightly schedule, served from this process.

`serve` registers the deployment with the Prefect API in PREFECT_API_URL and executes its runs as
subprocesses in this project. Teams with their own server or a Kubernetes/process work pool use
`prefect deploy` with prefect.yaml instead (same name, same schedule).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from finetune.workspace import find_project_root
from flows.finetune import PROJECT_ROOT, finetune


class DeploymentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "default"
    cron: str = "0 2 * * *"
    timezone: str = "UTC"
    params_file: str = "params/default.yaml"
    concurrency_limit: int = Field(1, gt=0)


def load_settings(path: Path | None = None) -> DeploymentSettings:
    from pydantic import ValidationError

    from finetune.config.loader import explain
    from finetune.errors import PipelineError

    path = path or find_project_root(PROJECT_ROOT) / "params/deployment.yaml"
    try:
        return DeploymentSettings.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValidationError as exc:
        raise PipelineError(f"{path}: {explain(exc.errors()[0])}") from None


def serve(settings: DeploymentSettings | None = None) -> None:
    from prefect.schedules import Cron

    s = settings or load_settings()
    finetune.serve(
        name=s.name,
        schedule=Cron(s.cron, timezone=s.timezone),
        parameters={"params_file": s.params_file,
                    "workspace": str(find_project_root(PROJECT_ROOT))},
        global_limit=s.concurrency_limit,
        description="Fine-tune on params/default.yaml; skips when DVC says up to date.",
        tags=["finetune", "nightly"],
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit("usage: python -m flows.deploy serve")
    serve()
