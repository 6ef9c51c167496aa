"""`dvc plots show` offline: a page template that carries Vega, Vega-Lite and Vega-Embed.

DVC's page loads the three libraries from a CDN, so without a network (a cluster node, a
laptop on a train) it is blank. `make setup` runs this module once: it fetches the npm
packages at the versions DVC's own page names (`dvc_render.vega.VegaRenderer.SCRIPTS`) with
`npm pack`, keeps their minified builds and BSD-3 licences under `.cache/vega/`, writes a page
template with the three inlined (and their licences in a comment), and names it in
`.dvc/config.local` (`plots.html_template`), so a plain `dvc plots show` uses it from then on.
The local config is untracked: a clone that has not run the setup keeps DVC's own page.

    python -m flows.plots_page [--root PROJECT]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from finetune.errors import PipelineError

#: where the template, the builds and the licences go (gitignored with the rest of .cache/)
CACHE = Path(".cache/vega")
TEMPLATE = "dvc-plots.html"
#: package -> its minified browser build inside the npm tarball
BUILDS = {"vega": "build/vega.min.js", "vega-lite": "build/vega-lite.min.js",
          "vega-embed": "build/vega-embed.min.js"}

PAGE = """<!DOCTYPE html>
<!--
Vega, Vega-Lite and Vega-Embed inlined by flows/plots_page.py (no network needed):
{credits}
-->
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>DVC plots</title>
{scripts}
    <style>
        body {{ font-family: sans-serif; }}
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def dvc_versions() -> dict[str, str]:
    """The versions DVC's own page loads from its CDN (the specs it writes are made for them)."""
    from dvc_render.vega import VegaRenderer

    found = dict(re.findall(r"/npm/(vega(?:-lite|-embed)?)@([\d.]+)", VegaRenderer.SCRIPTS))
    if set(found) != set(BUILDS):
        raise PipelineError(f"dvc_render's page names {sorted(found)}, not {sorted(BUILDS)}: "
                            "flows/plots_page.py needs updating for this DVC")
    return found


def fetch(versions: dict[str, str], into: Path) -> dict[str, tuple[str, str]]:
    """`npm pack` each package; its build and LICENSE text, by package."""
    npm = shutil.which("npm")
    if npm is None:
        raise PipelineError("npm not found: install Node.js (Debian: apt-get install npm), then "
                            "`make setup` again; until then `dvc plots show` loads Vega from "
                            "its CDN")
    specs = [f"{name}@{version}" for name, version in versions.items()]
    proc = subprocess.run([npm, "pack", *specs, "--pack-destination", str(into), "--silent"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(f"npm pack {' '.join(specs)} failed: {tail}")
    parts = {}
    for name, version in versions.items():
        with tarfile.open(into / f"{name}-{version}.tgz") as tar:
            def read(member: str) -> str:
                return tar.extractfile(f"package/{member}").read().decode()

            parts[name] = (read(BUILDS[name]), read("LICENSE"))
    return parts


def page(versions: dict[str, str], parts: dict[str, tuple[str, str]]) -> str:
    """The template: DVC's placeholders, the three builds inline, no `{scripts}` (where DVC
    would put its CDN tags)."""
    credits, scripts = [], []
    for name, (build, licence) in parts.items():
        credits.append(f"{name} {versions[name]} (npm), BSD-3-Clause:\n\n{licence.strip()}\n")
        # nothing in a build may end its script element ("<\/script" is the same string in
        # JS) or be one of the placeholders DVC fills
        build = build.replace("</script", "<\\/script")
        clash = [p for p in ("{plot_divs}", "{refresh_tag}", "{scripts}") if p in build]
        if clash or "-->" in licence:
            raise PipelineError(f"{name} {versions[name]}'s build holds {clash or '-->'}: it "
                                "cannot be inlined into DVC's page template")
        scripts.append(f"    <script>/* {name} {versions[name]} */\n{build}\n    </script>")
    return PAGE.format(credits="\n".join(credits), scripts="\n".join(scripts))


def install(root: Path) -> Path:
    """Write the template and its licences under root/.cache/vega, and name it in DVC's local
    config; the template's path."""
    versions = dvc_versions()
    cache = root / CACHE
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        parts = fetch(versions, Path(tmp))
    for name, (_, licence) in parts.items():
        (cache / f"{name}-{versions[name]}.LICENSE").write_text(licence)
    target = cache / TEMPLATE
    staged = target.with_name(f".{TEMPLATE}.tmp-{os.getpid()}")
    staged.write_text(page(versions, parts))
    os.replace(staged, target)
    dvc = Path(sys.executable).parent / "dvc"
    # relative to .dvc/, as DVC reads it: the project can move
    setting = os.path.relpath(target, root / ".dvc")
    proc = subprocess.run([str(dvc), "config", "--local", "plots.html_template", setting],
                          cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PipelineError(f"dvc config --local plots.html_template: {proc.stderr.strip()}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the project")
    args = parser.parse_args(argv)
    try:
        target = install(args.root.resolve())
    except PipelineError as exc:
        print(f"plots page: {exc}", file=sys.stderr)
        return 1
    print(f"plots page: `dvc plots show` draws offline with {target.relative_to(args.root.resolve())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
