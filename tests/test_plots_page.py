"""The offline `dvc plots show` template (flows/plots_page.py), built from stand-in builds: no
npm here. tests/test_pipeline.py draws the real one in Chromium with no network."""

from __future__ import annotations

import pytest

from finetune.errors import PipelineError
from flows.plots_page import BUILDS, dvc_versions, page

VERSIONS = {"vega": "5.20.2", "vega-lite": "5.2.0", "vega-embed": "6.18.2"}


def parts(**builds: str) -> dict[str, tuple[str, str]]:
    return {name: (builds.get(name.replace("-", "_"), f"window.{name.replace('-', '_')}=1;"),
                   f"Copyright {name}\nAll rights reserved.") for name in BUILDS}


def test_the_versions_are_those_dvcs_own_page_loads():
    from dvc_render.vega import VegaRenderer

    versions = dvc_versions()
    assert set(versions) == set(BUILDS)
    for name, version in versions.items():
        assert f"/npm/{name}@{version}\"" in VegaRenderer.SCRIPTS


def test_the_template_inlines_the_builds_and_keeps_dvcs_placeholders():
    from dvc_render.html import HTML

    template = page(VERSIONS, parts(vega_lite='var s = "</script>";'))
    # no {scripts}: DVC would put its CDN tags there
    assert "{scripts}" not in template and "<script src" not in template
    assert template.count("{plot_divs}") == 1 and template.count("{refresh_tag}") == 1
    assert "window.vega=1;" in template and "window.vega_embed=1;" in template
    assert 'var s = "<\\/script>";' in template and "</script>\";" not in template
    for name, version in VERSIONS.items():
        assert f"{name} {version} (npm), BSD-3-Clause:\n\nCopyright {name}" in template
    filled = HTML(template).with_scripts("<script src=cdn></script>").with_element(
        "<div id=loss></div>").embed()
    assert "<div id=loss></div>" in filled and "cdn" not in filled


def test_a_build_holding_a_placeholder_is_refused():
    with pytest.raises(PipelineError, match=r"vega-embed 6.18.2's build holds \['\{plot_divs\}'\]"):
        page(VERSIONS, parts(vega_embed="x = '{plot_divs}';"))
