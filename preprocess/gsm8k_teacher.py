"""The teacher of the distillation example (params/distill-gsm8k.yaml): the shipped base,
data/models/stories260K, fully fine-tuned on the shipped GSM8K train rows by our own pipeline.
Writes the model folder data/sft/gsm8k-teacher (gitignored, as data/sft/gsm8k is; made once):

    python -m preprocess.gsm8k_teacher          # params/gsm8k-teacher.yaml: 2 min on 2 idle cores

It runs params/gsm8k-teacher.yaml's download, format, tokenize and train stages (`finetune
stage NAME -p ...`, the commands dvc.yaml runs) in a temporary copy of the project holding
dvc.yaml, the params file and the inputs it names (the model folder and the data files), so
this checkout's data/ and dvc.lock are untouched, then copies the trained model (weights,
config and the base's tokenizer) to the output folder. The run is seeded (training.seed) and
its numerics portable (training.cpu_numerics), so a rebuild writes the same weights; their
sha256 is printed. Only the train rows are trained on: the test rows stay held out for the
distillation run's evaluate stage, which reports the teacher's held-out loss (teacher_loss).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

STAGES = ("download", "format", "tokenize", "train")


def inputs(params: dict) -> list[str]:
    """The project paths the params file reads: the model folder and the data files."""
    paths = [params["model"]["name_or_path"]]
    paths += list((params.get("data") or {}).get("data_files", {}).values())
    return paths


def copy_project(root: Path, params_file: Path, to: Path) -> Path:
    """A project in `to` with what the stages read; returns the params file's path there."""
    params = yaml.safe_load(params_file.read_text())
    shutil.copy2(root / "dvc.yaml", to / "dvc.yaml")  # the project root's marker
    for rel in inputs(params):
        src, dst = root / rel, to / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    dst = to / "params" / params_file.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(params_file, dst)
    return dst.relative_to(to)


def weights_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(root: Path, params_file: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="gsm8k-teacher-") as tmp:
        project = Path(tmp)
        params = copy_project(root, params_file, project)
        for stage in STAGES:
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "flows.cli", "stage", stage, "-p", str(params)],
                           cwd=project, check=True)
            print(f"[gsm8k_teacher] {stage}: {time.monotonic() - start:.0f} s", flush=True)
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(project / "data" / "trained", staging)
        staging.rename(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params/gsm8k-teacher.yaml"))
    parser.add_argument("--out", type=Path, default=Path("data/sft/gsm8k-teacher"))
    parser.add_argument("--force", action="store_true", help="rebuild an existing folder")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.out.exists() and not args.force:
        print(f"{args.out}: already built (--force rebuilds it)")
        return
    if args.out.exists():
        shutil.rmtree(args.out)
    start = time.monotonic()
    build(root, args.params.resolve(), root / args.out if not args.out.is_absolute() else args.out)
    print(f"{args.out}: built in {time.monotonic() - start:.0f} s, "
          f"weights sha256 {weights_sha256(args.out)}")


if __name__ == "__main__":
    main()
