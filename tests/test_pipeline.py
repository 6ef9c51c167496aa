"""`dvc repro` end to end on a copy of the project (its own git repo, DVC cache, MLflow store)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import BIN, PER_STEP_SERIES, ROOT, copy_project, write_params

from tasks.tracking import LINEAGE_TAGS

#: the whole pipeline through `dvc repro`, several times: `make test-slow` runs it
pytestmark = pytest.mark.slow

STAGES = ["download", "format", "tokenize", "teacher", "train", "evaluate", "export"]


def dvc(project, *args, check=True, env=None):
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=project, capture_output=True, text=True,
                          env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def ran(proc) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", proc.stdout)


@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    # the default run's portable CPU numerics (TINY sets native for the in-process tests)
    project = copy_project(tmp_path_factory.mktemp("pipe") / "p",
                           {"training.cpu_numerics": "portable"})
    # every stage also records which params keys it reads (finetune.config.reads)
    first = dvc(project, "repro", env={**os.environ, READS_ENV: str(_reads_dir(project))})
    return project, first


READS_ENV = "FINETUNE_CONFIG_READS"
#: keys a stage may read without listing them in dvc.yaml: they cannot change its outputs
NOT_OUTPUT_KEYS = {
    "logging.mlflow_tracking_uri": "where the MLflow store is; no DVC output records it",
    "data.num_proc": "tokenizer worker processes: the same tokens either way",
    "logging.disable_tqdm": "whether the evaluate stage draws a progress bar; same numbers",
    "logging.progress_bar": "which progress bar the evaluate stage draws; same numbers",
}


def _reads_dir(project):
    return project.parent / "config-reads"


def test_dvc_params_cover_every_key_each_stage_reads(repro):
    """DVC reruns a stage only when a listed key changes, so each key a stage (and, for
    train, every torchrun worker) read during the first repro must be listed for that stage
    in dvc.yaml: itself or its section."""
    project, _ = repro
    read = {}
    for path in _reads_dir(project).glob("*.json"):
        stage = path.name.rsplit("-", 1)[0]
        read.setdefault(stage, set()).update(json.loads(path.read_text()))
    assert sorted(read) == sorted(STAGES)
    assert "training.max_steps" in read["train"] and "data.max_seq_length" in read["tokenize"]
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    unlisted = {}
    for stage in STAGES:
        listed = [key for entry in stages[stage].get("params", [])
                  for key in entry["params/default.yaml"]]
        gaps = sorted(k for k in read[stage] - set(NOT_OUTPUT_KEYS)
                      if not any(k == key or k.startswith(key + ".") for key in listed))
        if gaps:
            unlisted[stage] = gaps
    assert unlisted == {}, f"keys read but not in dvc.yaml's params: {unlisted}"


def test_first_repro_runs_all_stages_and_finetuning_helps(repro):
    project, first = repro
    assert ran(first) == ["validate", *STAGES]
    ev = json.loads((project / "data/metrics/eval.json").read_text())
    assert ev["finetuned"]["loss"] < ev["base"]["loss"]
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"validate", *STAGES}
    shown = dvc(project, "metrics", "show", "--json").stdout
    assert "finetuned" in shown


def test_exported_model_reloads_and_generates(repro):
    project, _ = repro
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = project / "data/export"
    assert (export / "model.safetensors").exists() and (export / "README.md").exists()
    assert not (export / "adapter_config.json").exists(), "export must be merged, not an adapter"
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok("Question: Tom has 3 apples and buys 2 more. How many?\nAnswer:", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    card = (export / "README.md").read_text()
    assert "sha256" in card and "| finetuned |" in card


def test_mlflow_run_has_lineage(repro):
    project, _ = repro
    from mlflow.tracking import MlflowClient

    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert len(tags["git_commit"]) == 40 and tags["data_sha256"]
    # the whole lineage is one artifact; the run's tags show a summary of it
    lineage = run_lineage(run)
    assert {"dvc_stage.download", "dvc_stage.tokenize", "dvc_stage.train"} <= set(lineage)
    assert {k: tags[k] for k in LINEAGE_TAGS} == {k: lineage[k] for k in LINEAGE_TAGS}
    assert not [k for k in tags if k.startswith(("dvc_stage.", "dvc_out.", "data_sha256."))]
    assert run.data.metrics["eval.loss"] < run.data.metrics["eval.base_loss"]


def test_mlflow_metrics_are_the_step_curves_and_the_final_evaluation(repro):
    """The run's metrics page: exactly the series the loop logs per step and the evaluate
    stage's results (one value each, which MLflow draws as a labelled bar); no curve has a
    step-0 point holding its final value (the old train.json summary put `epoch`,
    `memory_rss_mb`, ... there); the run's facts (seed, world size, parameter counts,
    runtime) are tags, not single-bar charts."""
    project, _ = repro
    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    client = mlflow_client(project)
    run = client.get_run(run_id)
    ev = json.loads((project / "data/metrics/eval.json").read_text())
    train = json.loads((project / "data/metrics/train.json").read_text())
    evaluation = ({f"eval.{k}" for k in ev["finetuned"]}
                  | {f"eval.base_{k}" for k in ev["base"]}
                  | {f"contamination.{s}.overlap_fraction" for s in ev["contamination"]})
    assert set(run.data.metrics) == PER_STEP_SERIES | evaluation, (
        set(run.data.metrics) ^ (PER_STEP_SERIES | evaluation))
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        if key in evaluation:
            assert steps == [0], (key, steps)
        else:
            assert min(steps) >= 1 and len(steps) == len(set(steps)), (key, steps)
    facts = {k: v for k, v in run.data.tags.items() if k.startswith("train.")}
    assert facts["train.seed"] == str(train["seed"]) == run.data.params["training.seed"]
    assert facts["train.world_size"] == "1" and facts["train.strategy"] == "single"
    assert int(facts["train.total_params"]) > int(facts["train.trainable_params"]) > 0
    assert float(facts["train.train_runtime"]) > 0
    assert not {k.removeprefix("train.") for k in facts} & PER_STEP_SERIES


def mlflow_client(project):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")


def test_evaluate_writes_generation_metrics_samples_and_plots(repro):
    project, _ = repro
    ev = json.loads((project / "data/metrics/eval.json").read_text())
    assert ev["generation_rows"] == 16  # TINY keeps 16 test rows
    for model in ("base", "finetuned"):
        assert 0.0 <= ev[model]["exact_match"] <= 1.0
        # bootstrap stderrs over the test rows (eval.bootstrap_samples): what a guard in
        # standard errors reads (eval.loss_stderr in MLflow)
        assert 0 < ev[model]["loss_stderr"] < ev[model]["loss"], ev[model]
        assert ev[model]["perplexity_stderr"] > 0 and "exact_match_stderr" in ev[model]
    samples = json.loads((project / "data/eval/samples.json").read_text())
    assert len(samples) == 5
    assert set(samples[0]) == {"prompt", "reference", "generation", "base_generation"}
    assert samples[0]["prompt"].startswith("Question:") and "####" in samples[0]["reference"]
    assert samples[0]["generation"] != samples[0]["base_generation"]
    # DVC draws the panels dvc.yaml declares (no image: MLflow draws the metrics itself)
    plots = json.loads(dvc(project, "plots", "show", "--json").stdout)["data"]
    assert set(plots) == {"loss", "learning_rate", "grad_norm"}, set(plots)
    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    client = mlflow_client(project)
    logged = {a.path for folder in ("plots", "eval") for a in client.list_artifacts(run_id, folder)}
    assert logged == {"plots/train.csv", "plots/eval.csv", "eval/samples.json",
                      "eval/contamination.json"}, logged
    assert {"eval.exact_match", "eval.loss_stderr", "eval.base_loss_stderr"} <= set(
        client.get_run(run_id).data.metrics)


def test_export_has_adapter_and_registered_model_reloads(repro):
    project, _ = repro
    import mlflow
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = project / "data/export"
    merged = AutoModelForCausalLM.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(project / "data/models/stories260K")
    adapted = PeftModel.from_pretrained(base, export / "adapter")
    ids = torch.tensor([[1, 300, 301, 302, 303]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-4)
    record = json.loads((project / "data/lineage/model_version.json").read_text())
    assert record["promoted"] and record["aliases"] == ["candidate", "champion"]
    assert "first model" in record["reason"]
    from tasks.registry import use_tracking_uri

    with use_tracking_uri(f"sqlite:///{project / 'mlflow.db'}"):
        pyfunc = mlflow.pyfunc.load_model(f"models:/{record['name']}@champion")
        out = pyfunc.predict(["Question: Tom has 3 apples and buys 2 more. How many?\nAnswer:"])
        requirements = mlflow.pyfunc.get_model_dependencies(f"models:/{record['name']}@champion")
    assert len(out) == 1 and isinstance(out[0], str) and len(out[0]) > 0
    pins = open(requirements).read()
    assert "transformers==" in pins and "torch==" in pins and "torchvision" not in pins


def test_registered_version_walks_back_to_the_dataset(repro):
    """registry alias -> version -> tags and run -> the exact raw data, params and commit."""
    project, _ = repro
    import hashlib

    from mlflow.artifacts import load_dict

    client = mlflow_client(project)
    mv = client.get_model_version_by_alias("finetune-default", "champion")
    # the version's page: a lineage summary and the gate value, nothing that pushes the
    # aliases below the fold; the whole lineage is its run's lineage.json
    from tasks.registry import weight_hashes

    weights = {f"weights_sha256.{rel}": sha  # what `finetune reproduce` compares against
               for rel, sha in weight_hashes(project / "data/export").items()}
    assert {"model.safetensors", "adapter/adapter_model.safetensors"} <= {
        k.removeprefix("weights_sha256.") for k in weights}
    assert set(mv.tags) == {*LINEAGE_TAGS, "gate.eval.loss", "gate.eval.loss_stderr",
                            "gate.decision", *weights}, sorted(mv.tags)
    assert {k: mv.tags[k] for k in weights} == weights
    run = client.get_run(mv.run_id)
    lineage = run_lineage(run)
    whole = hashlib.sha256()
    for path in sorted((project / "data/raw").glob("*.parquet")):
        whole.update(path.name.encode())
        whole.update(path.read_bytes())
        assert lineage[f"data_sha256.{path.name}"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert mv.tags["data_sha256"] == lineage["data_sha256"] == whole.hexdigest()
    assert lineage["dvc_out.data/raw"] == out_hash(project, "download", "data/raw")
    assert lineage["dvc_out.data/tokenized"] == out_hash(project, "tokenize", "data/tokenized")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, capture_output=True,
                          text=True, check=True).stdout.strip()
    for tags in (mv.tags, run.data.tags, lineage):
        assert tags["git_commit"] == head and tags["git_dirty"] in ("true", "false")
    assert lineage["strategy"] == "single" and lineage["world_size"] == "1"
    # the CPU numerics it trained with (the default: portable, where this CPU can) and the CPU
    from finetune import numerics

    portable = numerics.portable_blocker("cpu") is None
    assert lineage["numerics.mode"] == mv.tags["numerics.mode"] == (
        "portable" if portable else "native")
    assert lineage["numerics.threads"] == "1"  # the tests' distributed.threads_per_process
    if portable:
        assert {k: lineage[f"numerics.{k}"] for k in numerics.PORTABLE_ENV} == \
            numerics.PORTABLE_ENV
    assert lineage["numerics.cpu_flags"] == numerics.cpu()["flags"]
    assert {"dvc_stage.download", "dvc_stage.train", "dvc_stage.evaluate"} <= set(lineage)
    params = load_dict(f"{run.info.artifact_uri}/resolved_params.json")
    written = yaml.safe_load((project / "params/default.yaml").read_text())
    assert params["training"]["max_steps"] == written["training"]["max_steps"]
    assert params["data"]["data_files"] == written["data"]["data_files"]


def run_lineage(run) -> dict:
    """The run's lineage.json artifact."""
    from mlflow.artifacts import load_dict

    return load_dict(f"{run.info.artifact_uri}/lineage.json")


def out_hash(project, stage, path):
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return next(o["md5"] for o in lock["stages"][stage]["outs"] if o["path"] == path)


def test_forced_retrain_reproduces_the_model_bit_for_bit(repro, tmp_path):
    """In another clone of the project, at another absolute path: nothing path-dependent may
    reach the trained folder (peft's README named the base model by its absolute path)."""
    project, _ = repro
    before = out_hash(project, "train", "data/trained")
    clone = tmp_path / "elsewhere"
    shutil.copytree(project, clone, symlinks=True)
    dvc(clone, "repro", "--force", "--single-item", "train")
    assert out_hash(clone, "train", "data/trained") == before
    status = dvc(clone, "status").stdout
    assert "up to date" in status, status  # evaluate/export see identical weights: no rerun


def _files(project: Path, *rels: str) -> dict[str, bytes]:
    found = {}
    for rel in rels:
        path = project / rel
        for f in ([path] if path.is_file() else sorted(path.rglob("*"))):
            if f.is_file():
                found[str(f.relative_to(project))] = f.read_bytes()
    return found


def test_a_stage_failing_under_repro_puts_back_what_dvc_deleted(repro, tmp_path):
    """No out is `persist` (DVC keeps no run-cache for a stage with one), so DVC deletes the
    train stage's outs before its command. The stage then fails on something only the data
    shows (a collate function that raises) and puts back, from DVC's cache, every out it had
    (the model, and the metrics and plots git keeps): the workspace is as it was, byte for
    byte, and the failure is still one line."""
    project, _ = repro
    clone = tmp_path / "c"
    shutil.copytree(project, clone, symlinks=True)
    outs = ("data/trained", "data/metrics/train.json", "data/plots/train.csv",
            "data/plots/eval.csv")
    before = _files(clone, *outs)
    (clone / "no_batches.py").write_text(
        "def collate(rows):\n    raise ValueError('no batch today')\n")
    write_params(clone, {"data.collate_fn": "no_batches:collate"})
    failed = dvc(clone, "repro", check=False)
    assert failed.returncode != 0 and ran(failed)[-1] == "train", failed.stdout
    assert ("[train] put back the previous outputs DVC deleted before the run: "
            "data/metrics/train.json, data/plots/eval.csv, data/plots/train.csv, "
            "data/trained") in failed.stdout, failed.stdout
    errors = [ln for ln in (failed.stdout + failed.stderr).splitlines()
              if ln.startswith("error: ")]
    assert len(errors) == 1 and "no batch today" in errors[0], errors
    assert _files(clone, *outs) == before


def test_a_clone_sharing_the_cache_restores_every_stage_from_the_run_cache(repro, tmp_path):
    """A teammate's clone (no outputs, no dvc.lock: copy_project leaves it out) pointed at the
    same DVC cache, as docs/orchestration.md shows: `finetune run` with the same code, params
    and data runs no stage. DVC's run-cache restores each one, the outputs and dvc.lock are
    the first run's byte for byte, a lineage record left in the clone (which no run here
    made) is dropped, and the summary says no MLflow run made these outputs here."""
    from helpers import run_cli

    project, _ = repro
    teammate = tmp_path / "teammate"
    git(tmp_path, "clone", "-q", str(project), str(teammate))
    dvc(teammate, "cache", "dir", "--local", str(project / ".dvc/cache"))
    dvc(teammate, "config", "--local", "cache.shared", "group")
    stale = teammate / "data/lineage/train_run.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"mlflow_run_id": "not-this-run"}')
    restored = run_cli(teammate, "run", check=True)
    assert ran(restored) == [], restored.stdout
    assert re.findall(r"Stage '(\w+)' is cached - skipping run", restored.stdout) == [
        "validate", *STAGES], restored.stdout
    assert not stale.exists()
    assert "MLflow run: none in " in restored.stdout, restored.stdout
    lock = lambda p: yaml.safe_load((p / "dvc.lock").read_text())["stages"]  # noqa: E731
    assert lock(teammate) == lock(project)
    outs = ("data/raw", "data/tokenized", "data/trained", "data/eval", "data/export")
    assert _files(teammate, *outs) == _files(project, *outs)


def git(project, *args):
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True,
                          check=True).stdout


def test_a_rerun_leaves_git_clean_and_a_stage_by_hand_says_how_to_get_back(repro, tmp_path):
    """The first hour: results committed, every stage rerun (a fresh clone's `finetune
    run`): `git status` stays clean (no timings, ids or timestamps in what git or dvc.lock
    records). Then one stage by hand with an override: it says the workspace now differs
    from dvc.lock and how to get back, ends its MLflow run, and what it says works."""
    from helpers import run_cli

    project, _ = repro
    clone = tmp_path / "clone"
    shutil.copytree(project, clone, symlinks=True)
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "the first run's results")
    rerun = dvc(clone, "repro", "--force")
    assert ran(rerun) == ["validate", *STAGES]
    assert git(clone, "status", "--porcelain") == "", git(clone, "diff")

    by_hand = run_cli(clone, "stage", "train", "-s", "training.max_steps=3", check=True)
    note = by_hand.stdout.strip().splitlines()[-1]
    assert note.startswith("[train] note: this run with -s training.max_steps=3 wrote its "
                           "outputs outside DVC, so the workspace now differs from dvc.lock"), note
    run_id = json.loads((clone / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    assert mlflow_client(clone).get_run(run_id).info.status == "FINISHED"
    assert "train" in dvc(clone, "status", "train").stdout
    for command in re.findall(r"`((?:dvc|git) [^`]+)`", note.split("To get back")[1]):
        args = command.split()
        args[0] = str(BIN / "dvc") if args[0] == "dvc" else args[0]
        subprocess.run(args, cwd=clone, check=True, capture_output=True)
    assert "up to date" in dvc(clone, "status").stdout
    assert git(clone, "status", "--porcelain") == ""


def test_second_repro_is_noop_and_training_change_reruns_only_later_stages(repro):
    project, _ = repro
    again = dvc(project, "repro")
    assert ran(again) == [] and "up to date" in again.stdout
    write_params(project, {"training.max_steps": 4})
    changed = dvc(project, "repro")
    assert ran(changed) == ["validate", "train", "evaluate", "export"]
    assert json.loads((project / "data/metrics/train.json").read_text())["global_step"] == 4
    # the shorter training is worse: registered, but the gate keeps the first one in service
    record = json.loads((project / "data/lineage/model_version.json").read_text())
    assert record["version"] == "2" and not record["promoted"], record
    assert record["aliases"] == ["candidate"] and record["champion_version"] == "1"
    mv = mlflow_client(project).get_model_version_by_alias("finetune-default", "champion")
    assert str(mv.version) == "1"


# -- what a person sees: the pages, screenshotted by headless Chromium ----------------------

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install "
    "chromium; .ci/run installs it): no screenshots of the MLflow and DVC pages")
#: a folder to copy the screenshots into, for a person to look at
SCREENS_ENV = "FINETUNE_SCREENSHOTS"
#: names a run's facts had when they were metrics (one-bar charts)
FACTS = {"seed", "world_size", "first_step_unix", "total_params", "trainable_params",
         "comm_bytes_total", "global_step", "train_runtime"}


class Chromium:
    """Headless Chromium with no network but 127.0.0.1, driven over the DevTools protocol
    (the `websockets` package Prefect brings): a page is read and screenshotted once a
    condition holds in it, waited for in real time (a loaded machine parses MLflow's
    charting code for seconds; a fixed virtual-time budget screenshotted spinners)."""

    def __init__(self, profile: Path):
        import time
        import urllib.request

        from websockets.sync.client import connect

        log = profile.with_name(f"{profile.name}.log")
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={profile}", "--window-size=1400,1000",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 "--remote-debugging-port=0", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        deadline = time.monotonic() + 60
        # it says "DevTools listening on ws://127.0.0.1:PORT/..." on stderr
        while not (said := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/",
                                     log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        port = said.group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as answer:
            page = next(t for t in json.load(answer) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None)
        self.calls = 0
        self.send("Emulation.setDeviceMetricsOverride", width=1400, height=1000,
                  deviceScaleFactor=1, mobile=False)

    def send(self, method: str, **params):
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            answer = json.loads(self.ws.recv())
            if answer.get("id") == self.calls:
                assert "error" not in answer, (method, answer["error"])
                return answer["result"]

    def evaluate(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression,
                         returnByValue=True)["result"].get("value")

    def open(self, url: str, png, ready: str = "true", timeout: float = 120) -> str:
        """Load `url`, wait until the JS expression `ready` holds, screenshot it into `png`
        (and into $FINETUNE_SCREENSHOTS); its DOM."""
        import base64
        import time

        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"document.readyState === 'complete' && ({ready})"):
            assert time.monotonic() < deadline, (
                f"{url}: not ({ready}) after {timeout:.0f} s; the page says: "
                f"{self.evaluate('document.body && document.body.innerText')!r:.3000}")
            time.sleep(0.5)
        time.sleep(1.5)  # the frame after: charts finish their transitions
        shot = self.send("Page.captureScreenshot", format="png")["data"]
        png.write_bytes(base64.b64decode(shot))
        if os.environ.get(SCREENS_ENV):
            shutil.copy(png, Path(os.environ[SCREENS_ENV]) / png.name)
        return self.evaluate("document.documentElement.outerHTML")

    def close(self) -> None:
        self.ws.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture
def chromium(tmp_path):
    browser = Chromium(tmp_path / "chromium")
    yield browser
    browser.close()


def visible_text(dom: str) -> str:
    """The DOM's text, without scripts and styles."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def ink(png) -> float:
    """The share of the screenshot's pixels that are not (near) white."""
    from PIL import Image

    with Image.open(png) as image:
        grey = image.convert("L")
        return sum(grey.histogram()[:230]) / (grey.width * grey.height)


@pytest.fixture
def mlflow_ui(repro, tmp_path):
    """`mlflow ui` on the project's store, on a free port of 127.0.0.1."""
    import socket
    import time
    import urllib.request

    project, _ = repro
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "mlflow-ui.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=project, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    (tmp_path / "mlflow-ui.log").read_text()[-2000:])
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
@needs_chromium
def test_mlflow_pages_show_curves_facts_and_the_champion(repro, mlflow_ui, chromium,
                                                          tmp_path):
    """After two trainings (the second not promoted): the run's metrics page counts and
    draws only its metrics (no fact as a chart), its overview lists the facts as tags, and
    the registered model's page and its champion version show a few lineage tags beside
    the aliases (not ~36 that pushed the champion below the fold)."""
    project, _ = repro
    client = mlflow_client(project)
    champion = client.get_model_version_by_alias("finetune-default", "champion")
    run = client.get_run(champion.run_id)
    run_page = f"{mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    text = "document.body.innerText"

    png = tmp_path / "mlflow-run-metrics.png"
    dom = chromium.open(f"{run_page}/model-metrics", png,
                        ready="document.querySelectorAll('.js-plotly-plot').length > 0")
    shown = re.search(r"Model metrics \( ?(\d+) ?\)", visible_text(dom))
    assert shown and int(shown.group(1)) == len(run.data.metrics), visible_text(dom)[:3000]
    # the charts drawn (the UI draws those in view), by their cards' titles
    charts = set(re.findall(r'title="([^"]+)"', dom)) & (set(run.data.metrics) | FACTS)
    assert charts and charts <= set(run.data.metrics), charts
    assert ink(png) > 0.01

    png = tmp_path / "mlflow-run-overview.png"
    page = visible_text(chromium.open(run_page, png, ready=f"{text}.includes('Tags')"))
    assert "train.seed" in page and "config_fingerprint" in page, page[:3000]
    assert "dvc_out." not in page and "dvc_stage." not in page
    assert ink(png) > 0.01

    png = tmp_path / "mlflow-registered-model.png"
    page = visible_text(chromium.open(f"{mlflow_ui}/#/models/finetune-default", png,
                                      ready=f"{text}.includes('Version 1')"))
    assert "champion" in page and "candidate" in page and "Version 2" in page, page[:3000]
    assert "git_commit" in page and "dvc_out." not in page and "data_sha256." not in page
    assert ink(png) > 0.01

    png = tmp_path / "mlflow-model-version.png"
    page = visible_text(chromium.open(
        f"{mlflow_ui}/#/models/finetune-default/versions/{champion.version}", png,
        ready=f"{text}.includes('Source Run')"))
    assert "champion" in page and "gate.eval.loss" in page, page[:3000]
    assert "dvc_stage." not in page
    assert ink(png) > 0.01


@pytest.mark.slow
@needs_chromium
def test_dvc_plots_page_draws_offline(repro, chromium, tmp_path):
    """`dvc plots show` with the template `make setup` writes (flows/plots_page.py, named in
    DVC's local config) draws its three panels with no network; DVC's own page, which loads
    Vega from a CDN, stays blank there."""
    from flows.plots_page import CACHE, TEMPLATE

    project, _ = repro
    template = ROOT / CACHE / TEMPLATE
    if not template.exists():
        pytest.skip(f"{template.relative_to(ROOT)} missing: `make setup` writes it (needs npm)")
    dvc(project, "plots", "show", "-o", str(tmp_path / "cdn"))
    blank = chromium.open((tmp_path / "cdn/index.html").as_uri(), tmp_path / "dvc-plots-cdn.png")
    assert "<canvas" not in blank and "<svg" not in blank  # offline, DVC's page draws nothing
    dvc(project, "config", "--local", "plots.html_template", str(template))
    try:
        dvc(project, "plots", "show", "-o", str(tmp_path / "page"))
    finally:
        dvc(project, "config", "--local", "--unset", "plots.html_template")
    page = (tmp_path / "page/index.html").read_text()
    assert "<script src" not in page and "cdn.jsdelivr" not in page
    for title in ("Training and eval loss", "Learning rate", "Gradient norm"):
        assert page.count(f'"text": "{title}"') == 1, title
    png = tmp_path / "dvc-plots.png"
    dom = chromium.open((tmp_path / "page/index.html").as_uri(), png,
                        ready="document.querySelectorAll('.vega-embed canvas').length == 3")
    assert dom.count('class="vega-embed') == 3 and dom.count("<canvas") == 3, dom[-3000:]
    assert ink(png) > 0.01 > 10 * ink(tmp_path / "dvc-plots-cdn.png")


def test_failing_repro_keeps_previous_outputs(repro):
    project, _ = repro
    export = project / "data/export/model.safetensors"
    weights = export.read_bytes()
    write_params(project, {"training.max_steps": 5, "optimizer.name": "NoSuchOpt"})
    failed = dvc(project, "repro", check=False)
    assert failed.returncode != 0
    assert "'NoSuchOpt' is not a torch.optim optimizer class" in failed.stdout + failed.stderr
    assert export.read_bytes() == weights
    assert (project / "data/trained/adapter_model.safetensors").exists()
    assert (project / "data/tokenized/train").exists()


def test_a_bad_lora_target_stops_repro_in_validate_and_keeps_every_output(repro, tmp_path):
    """A target module the model does not have (peft would ignore it next to one it has):
    `dvc repro` stops at the validate stage, so DVC runs, and clears the outputs of, no
    other stage: every file under data/, the metrics and plots included, is as it was."""
    import hashlib

    project, _ = repro
    clone = tmp_path / "c"
    shutil.copytree(project, clone, symlinks=True)
    subprocess.run(["git", "checkout", "params/default.yaml"], cwd=clone, check=True)

    def outputs() -> dict[str, str]:
        return {str(p.relative_to(clone)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((clone / "data").rglob("*")) if p.is_file()}

    before = outputs()
    assert "data/metrics/train.json" in before and "data/plots/train.csv" in before
    write_params(clone, {"peft.target_modules": ["q_proj", "nope_proj"],
                         "training.max_steps": 5})
    failed = dvc(clone, "repro", check=False)
    assert failed.returncode != 0 and ran(failed) == ["validate"], failed.stdout
    errors = [ln for ln in (failed.stdout + failed.stderr).splitlines()
              if ln.startswith("error: ")]
    assert len(errors) == 1 and "peft.target_modules: 'nope_proj' is not a module" in errors[0]
    assert outputs() == before


@pytest.mark.parametrize("text, says", [
    ("trainig:\n  max_steps: 3\n", "unknown key 'trainig'"),
    ("", "is empty"),
    ("training: [\n", "not valid YAML"),
])
def test_repro_checks_the_whole_params_file_before_any_stage(repro, tmp_path, text, says):
    """A key no stage lists (a misspelt section), an empty file, broken YAML: `dvc repro`
    runs our validation first and fails with its one line, not DVC's "up to date" or its own
    parser or missing-parameter messages."""
    project, _ = repro
    clone = tmp_path / "c"
    shutil.copytree(project, clone, symlinks=True)
    params = clone / "params/default.yaml"
    subprocess.run(["git", "checkout", "params/default.yaml"], cwd=clone, check=True)
    if "trainig" in text:
        text = params.read_text() + text
    params.write_text(text)
    failed = dvc(clone, "repro", check=False)
    assert failed.returncode != 0
    assert ran(failed) == ["validate"], failed.stdout
    errors = [ln for ln in (failed.stdout + failed.stderr).splitlines()
              if ln.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], failed.stdout + failed.stderr
    assert "missing" not in failed.stderr.replace(errors[0], "")
