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
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from helpers import BIN, ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = [README, *PAGES]
SECTIONS = ("model", "peft", "data", "training", "optimizer", "scheduler", "distributed",
            "checkpoint", "eval", "logging", "export", "registry")
#: the project's top-level folders and files a path in the docs may start with
TOP = ("params/", "tasks/", "engine/", "flows/", "finetune/", "tests/", "bench/", "data/",
       "preprocess/", "docs/", ".ci/", "dvc.yaml", "dvc.lock", "Makefile", "pyproject.toml",
       "constraints.txt", "prefect.yaml", "mkdocs.yml")
#: written by a run but neither a DVC output nor in git: the train logs, the train stage's
#: checkpoints and those a fresh run moves aside, an interrupted write's staging folders
RUN_PATHS = ("data/logs", "data/lineage", "data/checkpoints", "data/checkpoints.previous",
             "data/.trained.tmp-*",
             "data/sft/gsm8k",  # the DPO example's base: the default run's export, copied
             "data/sft/gsm8k-agent")  # the agent's base (make sft-agent), the same way
#: names that look like paths and are not: the Prefect deployment
NOT_PATHS = ("finetune/default",)
#: CLI subcommands that neither train nor write (`--write`, `--mark` and redirections write)
READ_ONLY = ("validate", "config", "reference")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(text: str, lang: str) -> list[tuple[int, list[str]]]:
    """(line number of the block's first line, its lines) of every fenced `lang` block, an
    indented one (under a list item) dedented."""
    found = []
    for match in re.finditer(rf"^( *)```{lang}\n(.*?)^\1```", text, flags=re.S | re.M):
        first = text.count("\n", 0, match.start(2)) + 1
        indent = len(match.group(1))
        found.append((first, [ln[indent:] for ln in match.group(2).splitlines()]))
    return found


def _fenced(text: str, lang: str) -> list[str]:
    return ["\n".join(lines) + "\n" for _, lines in _blocks(text, lang)]


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
    the section; with `<metric>_stderr` where the file's evaluation reports one."""
    import json

    from finetune.config import load_config
    from finetune.config.compat import has_stderr

    names = set(json.loads((ROOT / "data/metrics/eval.json").read_text()))
    for params in (ROOT / "params").glob("*.yaml"):
        if params.name != "deployment.yaml":
            cfg = load_config(params)
            for _, part in cfg.data.parts():
                reported = set(part.datatype.reported_metrics())
                names |= reported | {f"{n}_stderr" for n in reported
                                     if has_stderr(cfg, f"eval.{n}")}
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


# -- every shown command, run in order on a fresh clone (`make test-docs`, .ci/run's 3rd step) --

#: shown commands this test does not run, each with why (the command as shown, its comment off)
#: The Prefect stack's commands run in tests/test_e2e_prefect.py (make test-slow) instead: it
#: starts what `make stack` runs (finetune-stack) on a free port and runs the deployment as
#: shown (a full run, a cached one, one with overrides), checking what each did, the nightly
#: schedule, and that Ctrl-C leaves no process; here they would add a 50-step training and its
#: evaluation to the README's lane (~160 s of .ci/run's 45 minutes) to check exit codes only.
STACK_TEST = "run by tests/test_e2e_prefect.py against the stack it starts (make test-slow)"
NOT_RUN = {
    "make stack": STACK_TEST,
    "prefect deployment run finetune/default --watch": STACK_TEST,
    "prefect deployment run finetune/default --param overrides='{\"training.max_steps\": 50}' "
    "--watch": STACK_TEST,
    "prefect deployment run finetune/default --param overrides='[\"training.max_steps=300\"]' "
    "--watch": STACK_TEST,
    "make test": "the first step of .ci/run; this test is its third",
    "make setup && .venv/bin/python bench/suite.py":
        "the whole benchmark suite: ~35 min on 2 cores, and its Alpaca data and GPT-2 "
        "tokenizer are not shipped (the --quick line after it runs where they are)",
    "export PREFECT_API_URL=https://prefect.example.com/api":
        "a team's own Prefect server: needs the network and an account",
    "prefect work-pool create finetune-pool --type process": "on the team's server (above)",
    "FINETUNE_ROOT=$PWD prefect --no-prompt deploy --all": "on the team's server (above)",
    "prefect worker start --pool finetune-pool":
        "a worker that runs until stopped, on the team's server (above)",
}
#: shown commands that need the benchmarks' inputs, which the project does not ship (Alpaca's
#: licence): run where FINETUNE_BENCH_DATA (default: a `shared` folder beside the checkout)
#: holds them and FINETUNE_DOCS_BENCH=1 asks for them, else reported as not run, with why. Not
#: by default: the suite's smoke run took 3:50 alone on a quiet 2-core Xeon and 6:01 beside the
#: other docs lane: a checkout with the inputs beside it pays that (the likely cause of a CI
#: run of 48:14 against 39:56 for a clone without them here)
NEEDS_BENCH_DATA = {".venv/bin/python bench/suite.py --quick": "data/alpaca_2k.json"}
BENCH_DATA = Path(os.environ.get("FINETUNE_BENCH_DATA", ROOT.parent / "shared"))
BENCH_OPT_IN = "FINETUNE_DOCS_BENCH"
#: long-running servers: started in the background (their own process group), ready once the
#: URL answers with the text, stopped after their block with SIGINT (what Ctrl-C sends), and
#: every process of theirs must be gone then
BACKGROUND = {
    "make stack": ("http://127.0.0.1:4200/api/deployments/name/finetune/default",
                   '"default"'),
    "mlflow ui --backend-store-uri sqlite:///mlflow.db":
        ("http://127.0.0.1:5000/ajax-api/2.0/mlflow/experiments/search?max_results=50",
         '"finetune-default"'),  # the default run's experiment
}
#: a block that runs longer has hung (on a quiet 2-core CPU the longest take ~6 min; with other
#: work on the machine a 3-minute `make run` took 25)
BLOCK_TIMEOUT = 3600
#: functions each block's script starts with (on its first line, so block line k is line k+1)
_PRELUDE = r"""
docs_at() { echo "docs-test: $1 (${SECONDS}s)"; }
docs_fail() { echo "docs-test: FAILED at $1 with exit $2"; exit 1; }
docs_wait() {  # URL TEXT: until the URL's answer holds the text (5 minutes at most)
  "$DOCS_PYTHON" - "$1" "$2" <<'PY'
import sys, time, urllib.request
url, text = sys.argv[1:]
for _ in range(300):
    try:
        if text in urllib.request.urlopen(url, timeout=5).read().decode():
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"no {text} from {url} after 5 minutes")
PY
}
# one reader, one shell: the next block starts with this one's variables and folder
trap 'export -p > "$DOCS_LOGS/env.sh"; pwd > "$DOCS_LOGS/cwd"' EXIT
if [ -f "$DOCS_LOGS/cwd" ]; then source "$DOCS_LOGS/env.sh"; cd "$(cat "$DOCS_LOGS/cwd")"; fi
"""


def _command(line: str) -> str:
    """A shown line as it runs: its trailing `# comment` off."""
    return re.sub(r"(^|\s+)#\s.*$", "", line).strip()


def _docs_pages() -> list[tuple[str, list[tuple[int, list[str]]]]]:
    """(page, its bash blocks) in reading order: README, then docs/ (index.md is the README);
    a block shown on an earlier page too is left out (it ran there)."""
    seen, pages = set(), []
    for path in [README, *(p for p in PAGES if p.name != "index.md")]:
        blocks = []
        for first, lines in _blocks(path.read_text(), "bash"):
            if tuple(lines) not in seen:
                seen.add(tuple(lines))
                blocks.append((first, lines))
        if blocks:
            pages.append((_rel(path), blocks))
    return pages


def _bench_block_left_out(command: str) -> str | None:
    """Why a NEEDS_BENCH_DATA command is not run here, or None when it runs."""
    if os.environ.get(BENCH_OPT_IN) != "1":
        return f"a benchmark run, left out of .ci/run's budget ({BENCH_OPT_IN}=1 runs it)"
    needed = BENCH_DATA / NEEDS_BENCH_DATA[command]
    if not needed.exists():
        return (f"needs {needed} (not shipped; set FINETUNE_BENCH_DATA to the folder of the "
                "benchmarks' inputs)")
    return None


def _script(page: str, first: int, lines: list[str]) -> tuple[str, list[str]]:
    """The block as a bash script (each command verbatim, followed by a check that names its
    page and line: `a && b` failing in `a` does not stop `set -e`), and the background
    commands it starts."""
    out, background = [], []
    for k, line in enumerate(lines):
        where, command = f"{page}:{first + k}", _command(line)
        assert not line.endswith("\\"), f"{where}: continuation lines are not supported"
        if not command:
            out.append(line)
        elif command in NOT_RUN:
            out.append(f"echo {shlex.quote(f'docs-test: {where}: not run: {NOT_RUN[command]}')}")
        elif command in NEEDS_BENCH_DATA and (why := _bench_block_left_out(command)):
            out.append(f"echo {shlex.quote(f'docs-test: {where}: not run: {why}')}")
        elif command in BACKGROUND:
            url, text = BACKGROUND[command]
            log = f'"$DOCS_LOGS/{first + k}.log"'
            out.append(f"docs_at {where}; setsid {command} > {log} 2>&1 & "
                       f'echo $! >> "$DOCS_LOGS/background"; '
                       f"docs_wait {shlex.quote(url)} {shlex.quote(text)} "
                       f"|| {{ tail -n 30 {log}; docs_fail {where} 1; }}")
            background.append(command)
        else:
            out.append(f"docs_at {where}; {command} || docs_fail {where} $?")
    return "source \"$DOCS_LOGS/prelude.sh\"\n" + "\n".join(out) + "\n", background


#: the commands a teammate runs once in a new clone to share the team's DVC cache
#: (docs/orchestration.md, "Sharing work in a team"); every clone this test makes runs them
#: with one cache for the whole session, so a stage whose code, params and data equal a run
#: another clone already made is restored by DVC's run-cache instead of run again
TEAM_CACHE_SETUP = (("dvc", "cache", "dir", "--local", "{cache}"),
                    ("dvc", "config", "--local", "cache.shared", "group"))
#: the docs commands run on two lanes (the test classes below, one per xdist worker), each a
#: list of pages in order; a page's blocks stay on one lane, in reading order, in one
#: clone. The README page (the default run, the Prefect stack, lm-eval) is about as long as
#: all the others together
LANES = (("README.md",),
         ("docs/orchestration.md", "docs/distributed.md", "docs/gguf.md", "docs/benchmarks.md",
          "docs/training.md"))
#: a page whose set-up builds what a block of another page builds first: it waits for that
#: block (at most this long, and only while the block is still to run in this session), so
#: DVC's run-cache restores the shared work instead of both lanes running it side by side
#: (training.md's `make sft-base` is the README's `make run`)
WAITS_FOR = {"docs/training.md": ("README.md", 0)}
WAIT_AT_MOST = 1800


def _fresh_clone(dest: Path, cache: Path) -> Path:
    """`git clone` of this repository (its committed tree) with this test's environment as its
    `.venv` (the stamp `make` checks made newer than the clone's files, so nothing
    reinstalls), sharing the DVC cache `cache` as a teammate's clone does."""
    venv = BIN.parent
    stamp = venv / ".installed"
    assert stamp.is_file(), f"{stamp} is missing: run `make setup` first"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    (dest / ".venv").symlink_to(venv)
    with open(dest / ".git/info/exclude", "a") as fh:
        fh.write("/.venv\n")  # .gitignore's `.venv/` matches the folder a user has, not a link
    before = stamp.stat().st_mtime - 60
    for name in ("pyproject.toml", "constraints.txt"):
        os.utime(dest / name, (before, before))
    for command in TEAM_CACHE_SETUP:
        subprocess.run([str(BIN / command[0]), *(w.format(cache=cache) for w in command[1:])],
                       cwd=dest, check=True, capture_output=True)
    return dest


def _port_free(url: str) -> bool:
    from urllib.parse import urlparse

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", urlparse(url).port)) != 0


def _stop(pgid: int, timeout: float = 90) -> bool:
    """SIGINT to the group (Ctrl-C), then wait; True when every member left in time."""
    from flows.stack import group_alive

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not group_alive(pgid):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return False


class PageRun:
    """One page's clone, as a reader works through it in one shell: its blocks run in order,
    each in `bash -euo pipefail` (the next one starts with its variables and folder), each
    failing at the first command that fails, named with its page and line."""

    def __init__(self, page: str, blocks: list[tuple[int, list[str]]], home: Path,
                 shared: Path):
        self.page, self.blocks, self.shared = page, blocks, shared
        self.project = _fresh_clone(home / "project", shared / "dvc-cache")
        self.logs = home / "logs"
        self.logs.mkdir()
        (self.logs / "prelude.sh").write_text(_PRELUDE)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PREFECT_", "MLFLOW_TRACKING", "VIRTUAL_ENV", "FINETUNE_"))}
        # a reader's shell: the environment is not active until a block activates it
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                      if p and Path(p).resolve() != BIN.resolve())
        env.update(DOCS_LOGS=str(self.logs), DOCS_PYTHON=sys.executable)
        # two lanes share the cores: OpenMP threads that spin while they wait would take the
        # core the other lane's threads need (tests/conftest.py); the same numbers either way
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # the flow `make stack` serves asks the server for runs every 2 s instead of Prefect's
        # 10 s (as tests/test_e2e_prefect.py's): each `prefect deployment run` starts up to
        # 8 s sooner, a core idle meanwhile; what runs, and what the reader sees, is the same
        env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"
        if BENCH_DATA.is_dir():  # the benchmarks' inputs (the clone's own default would miss them)
            env["FINETUNE_BENCH_DATA"] = str(BENCH_DATA)
        self.env = env
        self.done = 0  # blocks run so far
        self.failed: str | None = None  # the block that failed, which every later one needs

    def where(self, index: int) -> str:
        return f"{self.page}:{self.blocks[index][0]}"

    def run(self, index: int) -> str:
        """Block `index` (the blocks before it have run); its timing line."""
        assert index == self.done, (index, self.done)
        first, lines = self.blocks[index]
        page = self.page
        script, background = _script(page, first, lines)
        for command in background:
            url = BACKGROUND[command][0]
            assert _port_free(url), f"{page}:{first}: {url} is taken: stop what listens there"
        started = time.monotonic()
        out = self.logs / f"{first}.out"  # written as it runs: `tail -f` it to follow a block
        self.done += 1
        self.failed = self.where(index)  # until it passes
        with open(out, "w") as sink:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script],
                                    cwd=self.project, env=self.env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                sink.write(f"\ndocs-test: FAILED at {page}:{first} with exit timeout "
                           f"({BLOCK_TIMEOUT} s)\n")
        output = out.read_text()
        timing = f"{page}:{first}: {time.monotonic() - started:.0f}s"
        background_file = self.logs / "background"
        pgids = [int(p) for p in background_file.read_text().split()] if (
            background_file.exists()) else []
        background_file.unlink(missing_ok=True)
        left = [pgid for pgid in pgids if not _stop(pgid)]
        failed = re.search(r"docs-test: FAILED at (\S+) with exit (\w+)", output)
        where = failed.group(1) if failed else f"{page}:{first}"
        shown = {f"{page}:{first + k}": _command(ln) for k, ln in enumerate(lines)}
        assert proc.returncode == 0 and not failed, (
            f"{where}: `{shown.get(where, '(the block)')}` failed "
            f"(exit {failed.group(2) if failed else proc.returncode}):\n"
            + "\n".join(output.splitlines()[-40:]))
        assert not left, f"{page}:{first}: {background} left processes after SIGINT"
        self.failed = None
        (self.shared / _done_marker(page, index)).touch()
        return timing


def _done_marker(page: str, index: int) -> str:
    return f"done-{page.replace('/', '_')}-{index}"


def _lane_params(lane: int) -> list:
    """One param per block of the lane's pages, in reading order, with the block as its id."""
    pages = dict(_docs_pages())
    laned = [p for pages_of_lane in LANES for p in pages_of_lane]
    assert sorted(laned) == sorted(pages), f"put every page on a lane: {set(pages) ^ set(laned)}"
    return [pytest.param(page, index, id=f"{page}:{pages[page][index][0]}")
            for page in LANES[lane] for index in range(len(pages[page]))]


@pytest.fixture(scope="session")
def docs_shared(tmp_path_factory) -> Path:
    """What this session's clones share, on every xdist worker: the DVC cache and the
    markers of the blocks that passed."""
    shared = tmp_path_factory.getbasetemp().parent / "docs-shared"
    (shared / "dvc-cache").mkdir(parents=True, exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory, docs_shared, request):
    """This worker's clone of each page, reused by the page's tests in reading order; the
    node ids of the session's tests (a page waits only for a block this session runs)."""
    runs: dict[str, PageRun] = {}
    selected = {item.nodeid for item in request.session.items}

    def get(page: str, index: int) -> PageRun:
        run = runs.get(page)
        if run is None or run.done > index:  # first here, or a block run again: a new clone
            pages = dict(_docs_pages())
            _wait_for_shared_work(page, docs_shared, selected)
            run = runs[page] = PageRun(page, pages[page], tmp_path_factory.mktemp("docs"),
                                       docs_shared)
        return run

    return get


def _wait_for_shared_work(page: str, shared: Path, selected: set[str]) -> None:
    if page not in WAITS_FOR:
        return
    other, index = WAITS_FOR[page]
    block_id = f"{other}:{dict(_docs_pages())[other][index][0]}"
    if not any(nodeid.endswith(f"[{block_id}]") for nodeid in selected):
        return
    deadline = time.monotonic() + WAIT_AT_MOST
    while not (shared / _done_marker(other, index)).exists() and time.monotonic() < deadline:
        time.sleep(5)


def _run_block(page: str, index: int, page_runs) -> None:
    run = page_runs(page, index)
    timings = []
    while run.done < index:
        if run.failed:
            break
        timings.append(run.run(run.done) + " (set-up)")
    if run.failed:
        pytest.fail(f"{run.where(index)} not run: the page's earlier block {run.failed} failed")
    timings.append(run.run(index))
    print("\n".join(timings))


# Each bash block of the README and docs/, as a reader runs it: on a fresh clone of the
# project, after the page's earlier blocks (the set-up: run here first when this worker has
# not run them, reused by the page's later tests when it has). One class per lane: `make
# test-docs` runs `--dist loadscope`, which keeps a class's tests on one worker in order
# (xdist's loadgroup cannot group under pytest 9: it renames node ids pytest no longer reads).

@pytest.mark.docs_commands
class TestReadmeLane:
    @pytest.mark.parametrize("page, index", _lane_params(0))
    def test_a_shown_block_runs_on_a_fresh_clone(self, page, index, page_runs):
        _run_block(page, index, page_runs)


@pytest.mark.docs_commands
class TestDocsLane:
    @pytest.mark.parametrize("page, index", _lane_params(1))
    def test_a_shown_block_runs_on_a_fresh_clone(self, page, index, page_runs):
        _run_block(page, index, page_runs)


def test_the_docs_commands_runner_finds_and_handles_every_command():
    """The pages' blocks are found (the README's four at least, the indented Prefect one
    among them), every command in NOT_RUN and BACKGROUND is still shown somewhere (no stale
    entries), and a failing command is named by its page and line."""
    pages = dict(_docs_pages())
    assert len(pages["README.md"]) >= 4
    shown = {_command(ln) for blocks in pages.values() for _, lines in blocks for ln in lines}
    assert "prefect deployment run finetune/default --watch" in shown
    listed = set(NOT_RUN) | set(BACKGROUND) | set(NEEDS_BENCH_DATA)
    assert listed <= shown, listed - shown
    # a benchmark block runs only when asked for and where its inputs are
    bench = next(iter(NEEDS_BENCH_DATA))
    with mock.patch.dict(os.environ, {BENCH_OPT_IN: ""}):
        assert "not run: a benchmark run, left out" in _script("B.md", 1, [bench])[0]
    with mock.patch.dict(os.environ, {BENCH_OPT_IN: "1"}):
        asked = _script("B.md", 1, [bench])[0]
        if (BENCH_DATA / NEEDS_BENCH_DATA[bench]).exists():
            assert "not run" not in asked and bench in asked
        else:
            assert f"not run: needs {BENCH_DATA}" in asked
    script, background = _script("P.md", 10, ["true  # fine", "false && true", "echo no"])
    assert background == []
    with tempfile.TemporaryDirectory() as logs:
        (Path(logs) / "prelude.sh").write_text(_PRELUDE)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                              text=True, env={**os.environ, "DOCS_LOGS": logs,
                                              "DOCS_PYTHON": sys.executable})
    assert proc.returncode == 1
    assert "docs-test: FAILED at P.md:11 with exit 1" in proc.stdout
    assert "no" not in proc.stdout.split("FAILED")[1]
    # the clones share their cache with the commands docs/orchestration.md shows a team, and
    # every block is a test on a lane
    page = (ROOT / "docs/orchestration.md").read_text()
    for command in TEAM_CACHE_SETUP:
        pattern = r"\s+".join(r"\S+" if w == "{cache}" else re.escape(w) for w in command)
        assert re.search(pattern, page), command
    ids = [p.id for lane in range(len(LANES)) for p in _lane_params(lane)]
    assert len(ids) == len(set(ids)) == sum(len(b) for _, b in _docs_pages())
    assert ids[0] == "README.md:12"
