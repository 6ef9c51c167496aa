"""Model references in the params (finetune/config/model_refs.py, tasks/model_refs.py): keys
marked `model_ref` on their field are walked, each list element that names a model (and only
those) found, a method's own section left out of another method's run, and every role has the
engine's check. The registry and the checks themselves run in tests/test_grpo_reward_model.py
(and `finetune reproduce`'s URIs in tests/test_reproduce.py)."""

from __future__ import annotations

import pytest

from finetune.config import FinetuneConfig
from finetune.config.model_refs import (REGISTERED_MODEL, ModelRef, model_ref_kind, model_refs,
                                        replaced)
from finetune.config.section import model_ref_keys
from test_grpo import _config

MIXED = ["format", "rewards.py:judge", "correctness", "./rm", "models:/scorer@champion",
         "models:/scorer/3"]


def test_a_reference_is_a_registered_model_or_a_folder_and_nothing_else():
    assert [model_ref_kind(v) for v in MIXED] == [None, None, None, "folder", "registered",
                                                  "registered"]
    assert REGISTERED_MODEL.fullmatch("models:/scorer@champion").group("name", "alias") == (
        "scorer", "champion")
    assert REGISTERED_MODEL.fullmatch("models:/scorer/3")["version"] == "3"
    for bad in ("models:/scorer", "models:/scorer@", "models:/a/b/3", "models:/s@a.b"):
        assert REGISTERED_MODEL.fullmatch(bad) is None, bad


def test_the_marked_keys_are_walked_element_by_element():
    """grpo.reward_funcs mixes built-ins, code and models: only the models are references,
    each named by its entry as the messages name it."""
    assert ("grpo.reward_funcs", "reward_model") in model_ref_keys(FinetuneConfig)
    cfg = _config({"grpo.reward_funcs": MIXED, "grpo.reward_weights": None})
    refs = model_refs(cfg)
    assert [(r.entry, r.ref, r.kind, r.role) for r in refs] == [
        ("grpo.reward_funcs[3]", "./rm", "folder", "reward_model"),
        ("grpo.reward_funcs[4]", "models:/scorer@champion", "registered", "reward_model"),
        ("grpo.reward_funcs[5]", "models:/scorer/3", "registered", "reward_model")]
    new = replaced(cfg, {refs[1]: "data/reward_models/v3/scorer"})
    assert new.grpo.reward_funcs == [*MIXED[:4], "data/reward_models/v3/scorer", MIXED[5]]
    assert cfg.grpo.reward_funcs == MIXED  # the copy changed, not the config


def test_a_methods_own_section_counts_in_its_runs_only():
    """A reward model in the grpo section of an SFT run's params is never loaded: it is
    neither checked nor resolved (as when the resolver read grpo.reward_funcs by name)."""
    cfg = _config({"grpo.reward_funcs": MIXED}, params="params/default.yaml")
    assert cfg.training.type == "sft"
    assert model_refs(cfg) == []


def test_every_role_has_the_engines_check():
    from engine.preflight import MODEL_FOLDER_CHECKS

    assert {role for _, role in model_ref_keys(FinetuneConfig)} <= set(MODEL_FOLDER_CHECKS)


@pytest.mark.parametrize("index,entry", [(None, "k.x"), (2, "k.x[2]")])
def test_an_entry_is_named_as_the_params_file_names_it(index, entry):
    assert ModelRef("k.x", index, "./m", "reward_model").entry == entry
