"""Data for bench/gpu.py, made on a machine with the whole stack (the GPU machine lacks pandera,
DVC and MLflow, so it cannot run our stages): Alpaca 2k through our own download, format and
tokenize stages with the GPT-2 tokenizer (completion-only labels, max_seq_length 1024), in a
throwaway copy of the project; the tokenized train split and the tokenizer are copied to OUT.

    python bench/gpu_prep.py OUT        # then carry OUT to the GPU machine
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import ALPACA, SHARED  # noqa: E402
from workdir import copy_project, set_params, stage  # noqa: E402


def config_only_model(tokenizer: Path, dest: Path) -> Path:
    """A Llama config with the tokenizer's vocabulary and the tokenizer: what the tokenize
    stage reads (no weights: bench/gpu.py builds them on the GPU)."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def through_stages(params: dict, out: Path, split: str) -> None:
    """Our own download, format and tokenize stages, in a throwaway copy of the project, with
    `params` over a config-only GPT-2-vocabulary Llama: the tokenized train split is copied to
    OUT/split and the tokenizer to OUT/tokenizer."""
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "p")
        model = config_only_model(SHARED / "models/gpt2-tokenizer", Path(tmp) / "model")
        set_params(project, {"model.name_or_path": str(model), **params})
        for name in ("download", "format", "tokenize"):
            print(f"{name}: {stage(project, name):.1f} s", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(project / "data/tokenized/train", out / split, dirs_exist_ok=True)
        shutil.copytree(model, out / "tokenizer", dirs_exist_ok=True)


def main(out: Path) -> None:
    through_stages({**ALPACA, "data.max_seq_length": 1024, "data.max_dropped_fraction": 0.5},
                   out, "alpaca-train")
    print(f"wrote {out}/alpaca-train and {out}/tokenizer")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
