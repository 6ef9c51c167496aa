"""The user code a params file names is hashed into the lineage and the checkpoint fingerprint
(finetune/user_code.py): an edited tool, environment or reward function is another run, which
a resume refuses by name (engine.state.fingerprint.differences), and a built-in is no user
code."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_grpo_tools import CALC

from engine.state.fingerprint import compute, differences
from finetune.config import FinetuneConfig
from finetune.config.fingerprint import CONTENT_KEYS
from finetune.imports import project_files
from finetune.user_code import code_hashes, references

TOOLS = CALC  # a tool file (its content does not matter here, only that it is one)
ENV = '''
class Counter:
    def reset(self, **row):
        self.n = 0

    def tick(self) -> int:
        """Counts."""
        self.n += 1
        return self.n
'''
REWARD = '''
def score(completions, **kwargs):
    return [1.0 for _ in completions]
'''


def _config(**grpo) -> FinetuneConfig:
    return FinetuneConfig.model_validate({
        "data": {"json_file_path": "x.jsonl", "dataset_type": "prompt", "prompt_template": None,
                 "completion_template": None},
        "training": {"type": "grpo"}, "grpo": grpo, "registry": {"gate_metric": "eval.reward"}})


@pytest.fixture
def project(tmp_path: Path):
    code = tmp_path / "preprocess"
    code.mkdir()
    for name, text in (("tools", TOOLS), ("env", ENV), ("reward", REWARD)):
        (code / f"{name}.py").write_text(text)
    with project_files(tmp_path):
        yield tmp_path


def test_each_reference_is_hashed_by_its_key_and_a_built_in_is_not(project):
    cfg = _config(tools=["preprocess/tools.py:add"],
                  environment_factory={"count": "preprocess/env.py:Counter"},
                  reward_funcs=["correctness", "preprocess/reward.py:score"])
    assert [k for k, _ in references(cfg)] == [
        "grpo.tools[0]", "grpo.environment_factory.count", "grpo.reward_funcs[1]"]
    hashes = code_hashes(cfg)
    assert set(hashes) == {"grpo.tools[0]", "grpo.environment_factory.count",
                           "grpo.reward_funcs[1]"}
    assert len(set(hashes.values())) == 3  # three files, three contents
    assert code_hashes(_config()) == {}  # the default GRPO run names built-ins only


def test_an_edited_environment_is_named_in_the_resume_refusal(project, tmp_path):
    cfg = _config(tools=["preprocess/tools.py:add"],
                  environment_factory="preprocess/env.py:Counter")
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(), data.mkdir()
    (model / "config.json").write_text("{}")
    before = compute(cfg, data, str(model))
    assert "user_code" in CONTENT_KEYS and set(before["user_code"]) == {
        "grpo.tools[0]", "grpo.environment_factory"}
    assert differences(before, compute(cfg, data, str(model))) == {}
    (project / "preprocess/env.py").write_text(ENV.replace("self.n += 1", "self.n += 2"))
    assert differences(before, compute(cfg, data, str(model))) == {
        "user_code": "grpo.environment_factory content changed"}
    fewer = _config(environment_factory="preprocess/env.py:Counter")
    assert differences(before, compute(fewer, data, str(model)))["user_code"] == (
        "grpo.environment_factory content changed, grpo.tools[0] removed")
    # a checkpoint written before user code was hashed has no entry: nothing to compare
    older = {k: v for k, v in before.items() if k != "user_code"}
    assert "user_code" not in differences(older, compute(cfg, data, str(model)))
