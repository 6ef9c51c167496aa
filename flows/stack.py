"""`finetune-stack`: the local Prefect stack in one command, stopped cleanly with Ctrl-C.

Starts a Prefect server on 127.0.0.1 with its SQLite database under `<project>/.prefect`
(skipped when PREFECT_API_URL points at an existing server), then serves the `finetune/default`
deployment with its nightly schedule. On SIGINT/SIGTERM it stops the serve process first (so it
can pause the schedule while the API is still up), then the server's whole process group: no
orphans are left.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from finetune.workspace import find_project_root

ROOT = find_project_root(Path(__file__).resolve().parents[1])


def wait_healthy(api_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"error: prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: prefect server at {api_url} not healthy after {timeout:.0f}s")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(proc: subprocess.Popen | None, sig: int, timeout: float) -> None:
    """Signal the whole process group and wait until every member is gone (SIGKILL if late)."""
    if proc is None:
        return
    pgid = proc.pid
    if proc.poll() is None and group_alive(pgid):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            return
        time.sleep(0.2)
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    while group_alive(pgid):
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune-stack", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=4200)
    parser.add_argument("--startup-timeout", type=float, default=120)
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "true")
    env.setdefault("DVC_NO_ANALYTICS", "1")  # DVC ignores DO_NOT_TRACK
    bindir = Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    server = serve = None
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if "PREFECT_API_URL" not in os.environ:
            env["PREFECT_API_URL"] = f"http://127.0.0.1:{args.port}/api"
            server = subprocess.Popen(
                [str(bindir / "prefect"), "server", "start", "--host", "127.0.0.1",
                 "--port", str(args.port)],
                cwd=ROOT, env=env, start_new_session=True)
            print(f"[stack] prefect server starting on 127.0.0.1:{args.port} "
                  f"(PREFECT_HOME={env['PREFECT_HOME']}, pid {server.pid})", flush=True)
        wait_healthy(env["PREFECT_API_URL"], args.startup_timeout, server)
        serve = subprocess.Popen([sys.executable, "-m", "flows.deploy", "serve"], cwd=ROOT,
                                 env=env, start_new_session=True)
        print(f"[stack] serving finetune/default (pid {serve.pid}); in another shell:\n"
              f"  export PREFECT_API_URL={env['PREFECT_API_URL']}\n"
              f"  prefect deployment run finetune/default --watch\n"
              f"[stack] Ctrl-C stops everything", flush=True)
        while not stopping:
            if serve.poll() is not None:
                print(f"[stack] serve exited with {serve.returncode}", flush=True)
                return serve.returncode or 1
            if server is not None and server.poll() is not None:
                print(f"[stack] server exited with {server.returncode}", flush=True)
                return server.returncode or 1
            time.sleep(0.5)
        return 0
    finally:
        stop(serve, signal.SIGINT, 30)   # serve first, while the API can still pause schedules
        stop(server, signal.SIGTERM, 30)
        print("[stack] stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
