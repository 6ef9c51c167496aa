"""A classifier's label map: the class names in id order, stored next to its data and
weights (labels.json), and the from_pretrained arguments that size its head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LABELS_FILE = "labels.json"


def write_labels(folder: Path, names: list[str]) -> Path:
    """A classifier's class names in id order, next to its data or weights."""
    path = Path(folder) / LABELS_FILE
    path.write_text(json.dumps(names))
    return path


def read_labels(path: Path | None) -> list[str] | None:
    """The class names in a folder (or a labels file); None when there are none."""
    if path is None:
        return None
    path = Path(path)
    path = path / LABELS_FILE if path.is_dir() else path
    return json.loads(path.read_text()) if path.exists() else None


def classifier_kwargs(labels: list[str], pad_token_id: int) -> dict[str, Any]:
    """from_pretrained arguments that size the classification head and store the label map in
    the model config; the pad id lets the classifier find each row's last real token."""
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {name: i for i, name in enumerate(labels)},
            "pad_token_id": pad_token_id}
