"""`finetune` console script: run a stage, the whole pipeline, validate or print a config.

    finetune stage train [-p params/default.yaml] [-s training.max_steps=10]
    finetune stage train --dry-run   # the torchrun command or sbatch script it would start
    finetune run                  # dvc repro + summary
    finetune validate -p params/x.yaml
    finetune config -s optimizer.learning_rate=3e-4
    finetune summary
    finetune show-rows --rows 2 --format html   # tokenized rows, trained tokens marked
    finetune registry rollback finetune-default --reason "worse in production"
    finetune reproduce models:/finetune-default@champion   # rebuild it, compare the bytes
    finetune publish models:/finetune-default@champion --to hf://me/my-model
    finetune serve                # the champion on an OpenAI-compatible server (127.0.0.1)

Errors print as one line (`error: ...`) with exit code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from finetune.errors import PipelineError
from finetune.workspace import DEFAULT_PARAMS, Workspace


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--params", default=DEFAULT_PARAMS, help="params file (YAML)")
    p.add_argument("-s", "--set", dest="overrides", action="append", default=[],
                   metavar="[FILE:]KEY=VALUE",
                   help="override one key (repeatable), as dvc exp run -S does: KEY=VALUE changes "
                   "a key of the params file, +KEY=VALUE adds one, ++KEY=VALUE adds or changes, "
                   "~KEY deletes")


def build_parser() -> argparse.ArgumentParser:
    from tasks import STAGES

    parser = argparse.ArgumentParser(prog="finetune", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stage", help="run one pipeline stage (what dvc.yaml calls)")
    st.add_argument("name", choices=STAGES)
    _common(st)
    st.add_argument("--dry-run", action="store_true",
                    help="train: print what would start (the torchrun command, or the sbatch "
                    "script with distributed.launcher: slurm) and start nothing")
    run = sub.add_parser("run", help="run the whole pipeline with dvc repro, then summarise")
    _common(run)
    run.add_argument("--force", action="store_true", help="rerun every stage")
    val = sub.add_parser("validate", help="check a params file")
    _common(val)
    val.add_argument("--mark", type=Path, default=None,
                     help="when valid, write this file (dvc.yaml's validate stage: every other "
                     "stage depends on it, so `dvc repro` checks the whole file first)")
    _common(sub.add_parser("config", help="print the resolved config"))
    _common(sub.add_parser("summary", help="print the last run's results"))
    rows = sub.add_parser("show-rows", help="print the first tokenized rows decoded, the "
                          "trained tokens marked (after the tokenize stage)")
    _common(rows)
    rows.add_argument("--rows", type=int, default=2, help="how many rows (default 2)")
    rows.add_argument("--split", choices=("train", "test"), default="train")
    rows.add_argument("--format", dest="fmt", choices=("text", "html"), default="text",
                      help="text: trained text between ⟦ and ⟧; html: in <mark> inside a <pre>")
    reg = sub.add_parser("registry", help="manage the MLflow Model Registry's champion")
    reg_sub = reg.add_subparsers(dest="action", required=True)
    back = reg_sub.add_parser("rollback", help="move the champion alias back to the previous "
                              "champion (registry.champion_alias; the tracking URI of -p)")
    back.add_argument("name", help="registered model name")
    back.add_argument("--reason", default="rolled back by hand",
                      help="why, recorded as the version's rollback.reason tag")
    _common(back)
    rep = sub.add_parser("reproduce", help="rebuild a registered model from its lineage (its "
                         "commit, its inputs from the DVC remote) and compare its weights' sha256")
    rep.add_argument("model_uri", help="models:/NAME/VERSION or models:/NAME@ALIAS")
    rep.add_argument("--tracking-uri", default=None,
                     help="the MLflow store holding the registry (default: the one of -p)")
    rep.add_argument("--keep", action="store_true",
                     help="keep the temporary git worktree the model was rebuilt in")
    rep.add_argument("--tolerance", type=float, default=None, metavar="R",
                     help="where the numerics differ from the registered run's (another CPU "
                     "under native numerics, another mode or thread count): the largest weight "
                     "difference allowed, relative to the largest weight (default 0.001)")
    _common(rep)
    pub = sub.add_parser("publish", help="upload a promoted registered version's files and a "
                         "model card to a folder, an fsspec URL (s3://...) or a Hub repo")
    pub.add_argument("model_uri", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    pub.add_argument("--to", required=True, metavar="DEST",
                     help="a folder, an fsspec URL (s3://bucket/path, file://...), or "
                     "hf://OWNER/NAME (HF_ENDPOINT and HF_TOKEN are honoured)")
    pub.add_argument("--force", action="store_true",
                     help="publish a version the gate did not promote")
    _common(pub)
    srv = sub.add_parser("serve", help="serve a registered version (default: the champion) or "
                         "a model folder on an OpenAI-compatible server on 127.0.0.1")
    srv.add_argument("model", nargs="?", default=None,
                     help="models:/NAME@ALIAS, models:/NAME/VERSION or a model folder "
                     "(default: the champion alias of the default registered model)")
    srv.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    srv.add_argument("--gguf", default=None, metavar="TYPE",
                     help="serve the export's GGUF file of this type (e.g. q8_0) with "
                     "llama.cpp's server instead of transformers serve")
    _common(srv)
    ref = sub.add_parser("reference", help="print the params reference (markdown)")
    ref.add_argument("--write", action="store_true",
                     help="update the docs site's reference page (docs/reference.md) in place")
    return parser


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler stopping the job), raised where the command is:
    the launcher's `with` blocks stop their children, and the command says where it stopped."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, the shell's convention: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + signal.Signals[self.signame].value


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _interrupted(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The signal's name and the exit code for an interrupt (a bare KeyboardInterrupt: SIGINT)."""
    if isinstance(exc, Interrupted):
        return exc.signame, exc.exit_code
    return "SIGINT", 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = argv is None  # the `finetune` command itself, not a Python caller
    _quiet_env()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_interrupted)
    try:
        return COMMANDS[args.command](args)
    except PipelineError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        signame, code = _interrupted(exc)
        print(f"error: interrupted ({signame})", file=sys.stderr)
        return code
    except Exception as exc:  # a bug, not bad input: say so, and how to see more
        if args.debug:
            traceback.print_exc()
        else:
            print(f"error: internal error {type(exc).__name__}: {exc} (rerun with --debug)",
                  file=sys.stderr)
        return 1


def _quiet_env() -> None:
    from finetune.errors import quiet_import_noise

    quiet_import_noise()
    for key, value in (("DO_NOT_TRACK", "true"), ("MLFLOW_DISABLE_TELEMETRY", "true"),
                       ("DVC_NO_ANALYTICS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def cmd_stage(args) -> int:
    from engine.process.lifetime import bind_to_orchestrator_if_asked
    from tasks import stage_function

    bind_to_orchestrator_if_asked()  # under the orchestrator's dvc: a cancelled task ends us too

    ws = Workspace.load(args.params, args.overrides)
    if args.dry_run:
        if args.name != "train":
            raise PipelineError(f"--dry-run is for the train stage (it shows what train would "
                                f"start); stage {args.name} has nothing to show")
        from tasks.launchers import dry_run

        print(dry_run(ws), end="")
        return 0
    from finetune import numerics

    # training.cpu_numerics: portable's pins must be in place before torch does any work
    # (the command's own process only: main() called from Python leaves its caller's alone)
    if args.command_line:
        numerics.enter(numerics.plan(ws.config), argv=["-m", "flows.cli", *sys.argv[1:]])
    # project modules named in params ('module:function', 'path/to/file:Class') import from
    # the project root in every stage, as they do in the torchrun workers (cwd, PYTHONPATH)
    os.chdir(ws.root)
    if str(ws.root) not in sys.path:
        sys.path.insert(0, str(ws.root))
    from finetune.config import reads

    reads.start(args.name)  # only with FINETUNE_CONFIG_READS set (tests/test_pipeline.py)
    started = time.perf_counter()
    from finetune.files import remove_interrupted_writes
    from finetune.workspace import workspace_lock

    with workspace_lock(ws.root):  # every writer: under finetune run / the flow, theirs
        for path in remove_interrupted_writes(ws.root / "data"):  # no live run owns them now
            print(f"[{args.name}] removed {_rel(path, ws.root)}, left by an interrupted write")
        try:
            try:
                outputs = stage_function(args.name)(ws)
            except BaseException:
                _put_back_previous_outputs(ws.root, args.name)
                raise
        except KeyboardInterrupt as exc:
            where = ""
            if args.name == "train":
                from tasks.train import interrupted_summary

                where = "; " + interrupted_summary(ws)
            signame, code = _interrupted(exc)
            print(f"error: stage {args.name} interrupted ({signame}){where}", file=sys.stderr)
            return code
    shown = ", ".join(f"{k}={_rel(v, ws.root)}" for k, v in outputs.items())
    print(f"[{args.name}] done in {time.perf_counter() - started:.1f}s: {shown}")
    if "DVC_STAGE" not in os.environ:  # by hand, not as dvc.yaml's cmd: dvc.lock did not see it
        from flows.dvc_runner import out_of_sync_notice

        notice = out_of_sync_notice(ws.root, args.name, args.overrides)
        if notice:
            print(notice)
    return 0


def _put_back_previous_outputs(root: Path, name: str) -> None:
    """Under `dvc repro` (DVC_STAGE names this stage), DVC deleted the stage's outs before
    running it: a failed run puts the previous ones back from DVC's cache (flows/dvc_restore.py)
    so that the workspace keeps them, as it does when the stage is run by hand."""
    if os.environ.get("DVC_STAGE") != name:
        return
    from flows.dvc_restore import restore_previous_outputs, restored_note

    try:
        note = restored_note(name, *restore_previous_outputs(root, name))
    except Exception as exc:  # noqa: BLE001 - the stage's own error is the one to report
        note = f"[{name}] could not put back the previous outputs ({exc}): `dvc checkout {name}`"
    if note:
        print(note, flush=True)


def cmd_validate(args) -> int:
    from tasks.checks import check_without_data

    ws = Workspace.load(args.params, args.overrides)
    os.chdir(ws.root)  # the params' file references resolve in the project, as in a stage
    if str(ws.root) not in sys.path:
        sys.path.insert(0, str(ws.root))
    check_without_data(ws)
    _print_deepspeed_table(ws)
    print(f"ok: {ws.params_path} is valid")
    if args.mark:  # constant content: a valid edit reruns no stage that depends on it
        args.mark.parent.mkdir(parents=True, exist_ok=True)
        args.mark.write_text("the params file passed `finetune validate`\n")
    return 0


def cmd_config(args) -> int:
    import yaml

    ws = Workspace.load(args.params, args.overrides)
    _print_deepspeed_table(ws, sys.stderr)  # stdout is the resolved file
    print(yaml.safe_dump(ws.config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _print_deepspeed_table(ws: Workspace, stream=None) -> None:
    """training.deepspeed_config's keys as ours (finetune/config/deepspeed.py), when set, and
    the one warning line for its keys that have no effect here."""
    source = ws.config.training.deepspeed_config
    if source is not None:
        from finetune.config.deepspeed import describe
        from finetune.errors import warn

        table, no_effect = describe(source, ws.root)
        print(table, file=stream or sys.stdout)
        if no_effect:
            warn(no_effect)


def cmd_run(args) -> int:
    ws = Workspace.load(args.params, args.overrides)
    if args.overrides or ws.params_path.resolve() != (ws.root / DEFAULT_PARAMS).resolve():
        raise PipelineError(
            f"finetune run reproduces {DEFAULT_PARAMS} (what dvc.yaml tracks); edit it, or run "
            "single stages with 'finetune stage NAME -p FILE -s KEY=VALUE'"
        )
    from finetune.workspace import workspace_lock
    from flows.dvc_runner import dvc_env, dvc_exe, forget_lineage_of_restored

    started = time.perf_counter()
    cmd = dvc_exe() + ["repro"] + (["--force"] if args.force else [])
    with workspace_lock(ws.root):  # the Prefect flow takes the same lock
        # DVC's output passed through as it comes (same process group: Ctrl-C reaches it)
        proc = subprocess.Popen(cmd, cwd=ws.root, env=dvc_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)
        proc.wait()
        forget_lineage_of_restored(ws.root, "".join(lines))
    if proc.returncode != 0:
        raise PipelineError(f"dvc repro failed (exit {proc.returncode}); the failing stage's "
                            "error is printed above")
    print(f"\npipeline finished in {time.perf_counter() - started:.1f}s\n")
    return cmd_summary(args)


def cmd_summary(args) -> int:
    from flows.report import markdown, summary

    ws = Workspace.load(args.params, [])
    info = summary(ws)
    if not info["eval"]:
        raise PipelineError(f"{ws.layout.metrics / 'eval.json'} missing: run the pipeline first")
    print(markdown(info))
    print(f"curves: dvc plots show  |  mlflow ui --backend-store-uri {ws.mlflow_uri()}")
    return 0


def cmd_show_rows(args) -> int:
    from tasks.show_rows import show_rows

    ws = Workspace.load(args.params, args.overrides)
    print(show_rows(ws, args.split, args.rows, args.fmt))
    return 0


def cmd_registry(args) -> int:
    from tasks import registry, tracking

    ws = Workspace.load(args.params, args.overrides)
    print(registry.rollback(tracking.client(ws), args.name, ws.config.registry, args.reason))
    return 0


def cmd_reproduce(args) -> int:
    from tasks.reproduce import reproduce

    ws = Workspace.load(args.params, args.overrides)
    return reproduce(ws.root, args.model_uri, args.tracking_uri or ws.mlflow_uri(), args.keep,
                     tolerance=args.tolerance)


def cmd_publish(args) -> int:
    from tasks.publish import publish

    ws = Workspace.load(args.params, args.overrides)
    for line in publish(ws, args.model_uri, args.to, args.force):
        print(line, flush=True)
    return 0


def cmd_serve(args) -> int:
    from tasks.serve import serve

    ws = Workspace.load(args.params, args.overrides)
    return serve(ws, args.model, args.port, args.gguf)


def cmd_reference(args) -> int:
    from finetune.config.reference import embed, render

    if args.write:
        page = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
        page.write_text(embed(page.read_text()))
        print(f"updated {page}")
    else:
        print(render(), end="")
    return 0


def _rel(path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


COMMANDS = {"stage": cmd_stage, "run": cmd_run, "validate": cmd_validate, "config": cmd_config,
            "summary": cmd_summary, "reference": cmd_reference,
            "show-rows": cmd_show_rows, "registry": cmd_registry, "reproduce": cmd_reproduce,
            "publish": cmd_publish, "serve": cmd_serve}

if __name__ == "__main__":
    sys.exit(main())
