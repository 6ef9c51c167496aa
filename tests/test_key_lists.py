"""The lists kept next to the schema agree with it: every key is classified for the checkpoint
fingerprint and listed for a DVC stage, no list names a key that no longer exists, and each
stage's DVC dependencies cover the code that makes its outputs. (What a stage actually reads
is compared with dvc.yaml during a real repro: tests/test_pipeline.py.)"""

from __future__ import annotations

import ast
import json
import shutil

import yaml

from helpers import ROOT
from finetune.config import fingerprint
from finetune.config.loader import _all_keys

KEYS = _all_keys()
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
LISTED = {stage: [k for entry in spec.get("params", []) for k in entry["params/default.yaml"]]
          for stage, spec in STAGES.items()}


def _covers(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def test_every_key_is_classified_once_for_the_fingerprint():
    """Each key's field says whether it is in the fingerprint (finetune.config.section.Field's
    `fingerprint`): a key that counts says True on its own field (no key decides resumes by
    default, nor by its section's say), a key left out says False or sits in a sub-section
    whose field says False."""
    def left_out(key):
        return not fingerprint.counts(key)

    unclassified = [k for k in KEYS if not left_out(k) and k not in fingerprint.IN_FINGERPRINT]
    assert unclassified == [], ("give the field fingerprint=True or fingerprint=False "
                                f"(finetune.config.section.Field): {unclassified}")
    both = [k for k in fingerprint.IN_FINGERPRINT if left_out(k)]
    assert both == []
    assert not set(fingerprint.IN_FINGERPRINT) & set(fingerprint.NOT_IN_FINGERPRINT)
    assert set(fingerprint.IN_FINGERPRINT) | set(fingerprint.NOT_IN_FINGERPRINT) == set(KEYS)


def test_every_key_is_listed_for_a_stage_and_every_listed_key_exists():
    unlisted = [k for k in KEYS if not any(_covers(p, k) for ps in LISTED.values() for p in ps)]
    assert unlisted == [], f"list these in dvc.yaml under the stages that read them: {unlisted}"
    sections = {k.split(".")[0] for k in KEYS}
    stale = [(stage, p) for stage, ps in LISTED.items() for p in ps
             if p not in sections and not any(_covers(p, k) for k in KEYS)]
    assert stale == []


#: plumbing every stage imports that cannot change an output (errors, atomic writes, imports
#: by reference, paths, package docstrings)
#: code that finds, names and stores things but decides no output's content (finetune.registry
#: looks a name up, like finetune.imports; the classes it finds are the stages' deps)
PLUMBING = {"finetune", "finetune.errors", "finetune.files", "finetune.imports",
            "finetune.registry", "finetune.workspace", "tasks", "engine"}
STAGE_MODULES = {"validate": "tasks.checks", "download": "tasks.download",
                 "format": "tasks.format", "tokenize": "tasks.tokenize", "teacher": "tasks.teacher",
                 "train": "tasks.train",
                 "evaluate": "tasks.evaluate", "export": "tasks.export"}


def _modules() -> dict:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for pkg in ("finetune", "engine", "tasks") for p in (ROOT / pkg).rglob("*.py")}


def _imports(path, modules, anywhere: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in (ast.walk(tree) if anywhere else tree.body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m in modules}


def test_each_stage_depends_on_the_code_that_makes_its_outputs():
    """What a stage's module imports (anywhere in it), followed through those modules' own
    top-level imports, is under one of the stage's DVC deps: editing it reruns the stage."""
    modules = _modules()
    assert set(STAGE_MODULES) == set(STAGES)
    gaps = {}
    for stage, start in STAGE_MODULES.items():
        todo, seen = [start, *_imports(modules[start], modules, anywhere=True)], set()
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(_imports(modules[name], modules, anywhere=False))
        deps = [d.rstrip("/") for d in STAGES[stage].get("deps", [])]
        files = [str(modules[m].relative_to(ROOT)) for m in sorted(seen - PLUMBING)]
        missing = [f for f in files if not any(f == d or f.startswith(d + "/") for d in deps)]
        if missing:
            gaps[stage] = missing
    assert gaps == {}, f"add to dvc.yaml deps: {gaps}"
    for spec in STAGES.values():  # and no dependency names a file that is gone
        for dep in spec.get("deps", []):
            assert (ROOT / dep).exists() or dep.startswith("data/"), dep


#: the panels dvc.yaml's top-level `plots:` declares: title -> (x title, y title)
PANELS = {"Training and eval loss": ("optimizer step", "loss (cross-entropy per token)"),
          "Learning rate": ("optimizer step", "learning rate"),
          "Gradient norm": ("optimizer step", "gradient L2 norm")}


def plot_specs(page: str) -> list[dict]:
    """The Vega-Lite specs of a `dvc plots show` page (one `var spec = {...};` per panel)."""
    import re

    return [json.loads(m) for m in re.findall(r"var spec = (\{.*?\});\n", page, re.S)]


def test_dvc_plots_show_draws_each_series_once_against_the_step(tmp_path):
    """Asked of DVC itself, in a clone with the committed curves: the page `dvc plots show`
    renders has the declared panels only, each titled, drawn against the `step` column with
    named axes (declared as stage plots, train.csv and eval.csv each got a panel of their own
    against the CSV row number, its axis labelled "step", and the y axis "y"), and no image
    (curves.png drew the same series again)."""
    import subprocess

    from helpers import BIN, copy_project

    project = copy_project(tmp_path / "p")
    shutil.copytree(ROOT / "data/plots", project / "data/plots")
    proc = subprocess.run([str(BIN / "dvc"), "plots", "show", "-o", str(tmp_path / "html")],
                          cwd=project, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "html/index.html").read_text()
    assert "<img " not in page
    specs = plot_specs(page)
    assert sorted(s["title"]["text"] for s in specs) == sorted(PANELS)
    for spec in specs:
        x_title, y_title = PANELS[spec["title"]["text"]]
        assert spec["encoding"]["x"] == {"field": "step", "type": "quantitative",
                                         "title": x_title}, spec["encoding"]["x"]
        assert spec["layer"][0]["encoding"]["y"]["title"] == y_title
    loss = next(s for s in specs if s["title"]["text"] == "Training and eval loss")
    drawn = {row["filename::field"] for row in loss["data"]["values"]}
    assert drawn == {"train.csv::loss", "eval.csv::eval_loss"}, drawn


def test_each_plot_is_declared_once():
    """A file that is a stage's plot output and also a top-level plot is drawn twice by
    `dvc plots show`; the top-level section only adds plots made from data files."""
    stage_plots = {next(iter(p)) if isinstance(p, dict) else p
                   for stage in STAGES.values() for p in stage.get("plots", [])}
    top = yaml.safe_load((ROOT / "dvc.yaml").read_text()).get("plots", [])
    named = {p for p in top if isinstance(p, str)}
    assert not named & stage_plots, named & stage_plots
