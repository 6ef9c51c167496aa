"""What a stage prints is ours: no library deprecation banners, and no long silent stretch
(the evaluate stage draws a bar like training's)."""

from __future__ import annotations

import tomllib
import warnings

from helpers import ROOT

from finetune.config import load_config


def test_pyproject_licence_is_an_spdx_string():
    """A TOML-table licence made setuptools print its deprecation banner on every install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read it


def test_wrapping_and_loading_an_adapter_warns_nothing(tmp_path):
    """peft reads transformers' deprecated `is_gradient_checkpointing` on every wrap; the
    train, evaluate and export stages printed its FutureWarning."""
    from engine.modeling.adapter import apply_peft
    from engine.modeling.model import load_base_model, load_trained

    cfg = load_config(ROOT / "params/default.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_peft(load_base_model(cfg.model, ROOT), cfg.peft)
        model.save_pretrained(tmp_path)
        load_trained(cfg.model, cfg.peft, ROOT, tmp_path)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], \
        [str(w.message) for w in caught]


def test_dataset_inputs_log_without_an_ambiguous_source_warning(tmp_path):
    """MLflow registers its local-files source twice; resolving a file URI among them warned
    'can be interpreted in multiple ways' on every train stage."""
    from finetune.workspace import Workspace
    from tasks import tracking

    for split in ("train", "test"):
        (tmp_path / "data/tokenized" / split).mkdir(parents=True)
        (tmp_path / "data/tokenized" / split / "data.arrow").write_bytes(split.encode())
    ws = Workspace(config=load_config(ROOT / "params/default.yaml"), root=tmp_path,
                   params_path=tmp_path / "params/default.yaml")
    run_id = tracking.client(ws).create_run(
        tracking.client(ws).create_experiment("quiet")).info.run_id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracking.log_data_inputs(ws, run_id, tmp_path / "data/tokenized", {})
    assert not [w for w in caught if "multiple ways" in str(w.message)]
    inputs = tracking.client(ws).get_run(run_id).inputs.dataset_inputs
    assert sorted(i.dataset.name for i in inputs) == ["test", "train"]
    assert all(i.dataset.source_type == "local" for i in inputs)


def test_evaluation_batches_move_a_bar_like_training(capsys):
    """greedy_generate and evaluate_loss report each batch; work_bar draws them on stderr
    when the training bar would be drawn (logging.disable_tqdm false), and nothing when not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.rollout.greedy import encode_prompts, greedy_generate
    from engine.reporting.reporters import work_bar

    path = ROOT / "data/models/stories260K"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    prompts = encode_prompts(tok, ["Once upon a time", "The dog", "Lily"], None)
    shown = load_config(ROOT / "params/default.yaml", ["+logging.disable_tqdm=false"]).logging
    with work_bar(2, "evaluate", shown) as advance:
        greedy_generate(model, tok, prompts, batch_size=2, max_new_tokens=2, on_batch=advance)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("evaluate") and "2/2" in last, last
    hidden = load_config(ROOT / "params/default.yaml", ["+logging.disable_tqdm=true"]).logging
    calls = []
    with work_bar(2, "evaluate", hidden) as advance:
        greedy_generate(model, tok, prompts, batch_size=2, max_new_tokens=2,
                        on_batch=lambda: calls.append(advance()))
    assert len(calls) == 2 and capsys.readouterr().err == ""
