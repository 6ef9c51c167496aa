"""The docs site and the README stay true: the site builds with `mkdocs build --strict` (a broken
link or anchor fails), the params reference is the schema's, every command they show that does
not train runs (a `console` block's output must be what the page shows), and every params key,
repository path and module they name exists.

The commands run in-process through the CLI's own `main` (no process boundary is under test
here), in the project root, on the shipped files; none of them writes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = [README, *PAGES]
SECTIONS = ("model", "peft", "data", "training", "optimizer", "scheduler", "distributed",
            "checkpoint", "eval", "logging", "export", "registry")
#: the project's top-level folders and files a path in the docs may start with
TOP = ("params/", "tasks/", "engine/", "flows/", "finetune/", "tests/", "bench/", "data/",
       "preprocess/", "docs/", ".ci/", "dvc.yaml", "dvc.lock", "Makefile", "pyproject.toml",
       "constraints.txt", "prefect.yaml", "mkdocs.yml")
#: written by a run but neither a DVC output nor in git: the train logs, the checkpoints a
#: fresh run moves aside, an interrupted write's staging folders
RUN_PATHS = ("data/logs", "data/checkpoints.previous", "data/.trained.tmp-*",
             "data/sft/gsm8k")  # the DPO example's base: the default run's export, copied
#: names that look like paths and are not: the Prefect deployment
NOT_PATHS = ("finetune/default",)
#: CLI subcommands that neither train nor write (`--write`, `--mark` and redirections write)
READ_ONLY = ("validate", "config", "reference")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text outside fenced blocks (whose code is checked by running it, or is output)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _run_cli(command: str, monkeypatch) -> tuple[int, list[str]]:
    """`finetune ...` through the CLI's main in the project root: exit code, output lines."""
    from flows import cli

    argv = shlex.split(command)
    assert argv[0] == "finetune", command
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                code = cli.main(argv[1:])
            except SystemExit as exc:  # argparse's --help
                code = exc.code or 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, [ln for ln in buffer.getvalue().splitlines() if ln.strip()]


def _console_examples() -> list[tuple[str, str, list[str]]]:
    """(page, command, expected output lines) of every `$ finetune ...` in a console block."""
    examples = []
    for path in TEXTS:
        for block in _fenced(path.read_text(), "console"):
            for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
                command, *output = chunk.strip("\n").splitlines()
                examples.append((_rel(path), command, output))
    return examples


def _shown_commands() -> list[tuple[str, str]]:
    """(page, command) of every read-only `finetune` command shown in a bash block or inline,
    placeholders (`FILE`, `NAME`, `X.yaml`, `...`) left out."""
    found = []
    for path in TEXTS:
        text = path.read_text()
        lines = [ln for block in _fenced(text, "bash") for ln in block.splitlines()]
        for line in lines + _inline_code(text):
            words = shlex.split(line, comments=True)
            if not words or words[0] != "finetune":
                continue
            command = " ".join(shlex.quote(w) for w in words)
            if re.search(r"\b[A-Z]{2,}\b|X\.yaml|\.\.\.|<|>|&&", line):
                continue
            if "--help" in words or (
                    len(words) > 1 and words[1] in READ_ONLY
                    and not {"--write", "--mark"} & set(words)):
                found.append((_rel(path), command))
    first_page = {}
    for page, command in found:
        first_page.setdefault(command, page)
    return sorted((page, command) for command, page in first_page.items())


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site/reference/index.html").is_file()


def test_the_reference_page_is_generated_from_the_schema():
    from finetune.config.reference import embed

    page = (ROOT / "docs/reference.md").read_text()
    assert embed(page) == page, "run: finetune reference --write"
    assert "`training.per_device_train_batch_size`" in page


def test_the_readme_is_a_quick_start_that_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert "make run" in text and "make test" in text
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", text))
    assert linked == {p.name for p in PAGES} - {"index.md"}


def test_every_page_is_in_the_site_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert sorted(page for entry in nav for page in entry.values()) == sorted(
        p.name for p in PAGES)


def test_the_docs_speak_to_users():
    """No internal history (design seeds, issue numbers, sessions) and no path outside the
    repository, in the pages, the README or the reference the schema renders."""
    from finetune.config.reference import render

    texts = {_rel(p): p.read_text() for p in TEXTS} | {"finetune reference": render()}
    for name, text in texts.items():
        for pattern in (r"\bseeds? ?0\d\d", r"\bissue \d+", r"this session", r"\.\./shared"):
            hit = re.search(pattern, text, flags=re.I)
            assert hit is None, f"{name}: {hit.group(0)!r}"


@pytest.mark.parametrize("page, command, expected", _console_examples(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_console_example_prints_what_the_page_shows(page, command, expected, monkeypatch):
    code, lines = _run_cli(command, monkeypatch)
    assert lines == expected, f"{page}: {command}"
    assert code == (2 if expected and expected[0].startswith("error: ") else 0)


def test_the_console_examples_are_found():
    """The parser above finds the bad-input examples (a parser finding none would pass)."""
    assert len([e for e in _console_examples() if e[0] == "docs/validation.md"]) >= 8


@pytest.mark.parametrize("page, command", _shown_commands())
def test_a_shown_command_runs(page, command, monkeypatch):
    code, lines = _run_cli(command, monkeypatch)
    assert code == 0, f"{page}: {command}: " + "\n".join(lines[-3:])


def test_the_shown_commands_are_found():
    commands = {c for _, c in _shown_commands()}
    assert {"finetune config", "finetune --help"} <= commands
    assert any(c.startswith("finetune validate -p ") for c in commands)


def _schema_keys() -> set[str]:
    """Every key the reference lists, its sections, and the aliases a params file may use."""
    from finetune.config.reference import render
    from finetune.config.schema import FinetuneConfig
    from finetune.config.section import section_model

    keys = {k.replace("[]", "") for k in re.findall(r"^\| `([^`]+)` \|", render(), flags=re.M)}
    keys |= {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}

    def aliases(model, prefix):
        for name, field in model.model_fields.items():
            alias = field.validation_alias
            for choice in getattr(alias, "choices", [alias] if isinstance(alias, str) else []):
                keys.add(f"{prefix}.{choice}")
            sub = section_model(field.annotation)
            if sub is not None:
                aliases(sub, f"{prefix}.{name}")

    for section, field in FinetuneConfig.model_fields.items():
        aliases(section_model(field.annotation), section)
    return keys


def _metric_names() -> set[str]:
    """`eval.<metric>` names the evaluate stage writes (data/metrics/eval.json, MLflow's
    `eval.*`) for the shipped params files' dataset types; they share the `eval.` prefix with
    the section."""
    import json

    from finetune.config import load_config

    names = set(json.loads((ROOT / "data/metrics/eval.json").read_text()))
    for params in (ROOT / "params").glob("*.yaml"):
        if params.name != "deployment.yaml":
            for _, part in load_config(params).data.parts():
                names |= set(part.datatype.reported_metrics())
    return {f"eval.{n}" for n in names} | {f"eval.base_{n}" for n in names}


def test_every_key_named_in_the_docs_exists():
    from finetune.config.methods import is_method_metric

    keys, metrics = _schema_keys(), _metric_names()
    bad = []
    for path in TEXTS:
        for span in _inline_code(path.read_text()):
            match = re.match(rf"^((?:{'|'.join(SECTIONS)})\.[\w.\[\]*]+)", span)
            if match is None:
                continue
            key = match.group(1).rstrip(".").replace("[]", "")
            if "*" in key:
                ok = any(fnmatch.fnmatch(k, key) for k in keys | metrics)
            else:
                # a harness metric: eval.harness.<task>.<metric>.<filter>, whatever the task
                ok = (key in keys or key in metrics
                      or re.fullmatch(r"eval\.harness(\.[\w-]+){3}", key) is not None
                      # a metric a training method reports (grpo's eval.sampled_reward_NAME)
                      or (key.startswith("eval.") and is_method_metric(key[len("eval."):])))
            if not ok:
                bad.append(f"{_rel(path)}: {span}")
    assert not bad, bad


def _dvc_outputs() -> set[str]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    outs = set()
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for out in stage.get(kind, []):
                outs.add(next(iter(out)) if isinstance(out, dict) else out)
    return {o.rstrip("/") for o in outs}


def test_every_path_named_in_the_docs_exists():
    made = _dvc_outputs() | set(RUN_PATHS)
    bad = []
    for path in TEXTS:
        for span in _inline_code(path.read_text()):
            word = span.split()[0].split(":")[0].rstrip(".,;")
            if not word.startswith(TOP) or word in NOT_PATHS:
                continue
            pattern = re.sub(r"<[^>]*>", "*", word).rstrip("/")
            if any((ROOT / p).exists() or list(ROOT.glob(p)) for p in (pattern, pattern + ".py")):
                continue  # a file, a folder, a glob, or a `path/to/file:function` reference
            if any(pattern == m or pattern.startswith(m + "/") or fnmatch.fnmatch(pattern, m)
                   for m in made):
                continue
            bad.append(f"{_rel(path)}: {span}")
    assert not bad, bad


def test_every_module_is_on_the_architecture_page():
    page = (ROOT / "docs/architecture.md").read_text()
    modules = [p for pkg in ("flows", "tasks", "engine", "finetune")
               for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"]
    missing = [_rel(m) for m in modules if f"`{_rel(m)}`" not in page]
    assert len(modules) > 80 and not missing, missing


def test_the_overview_page_is_the_readme():
    """docs/index.md is README.md with its links made relative to docs/: one text, two
    places (write it with: sed 's|](docs/|](|g' README.md > docs/index.md)."""
    readme = README.read_text()
    assert (ROOT / "docs/index.md").read_text() == readme.replace("](docs/", "](")
