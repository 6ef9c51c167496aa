"""A trained reward model as one of GRPO's reward functions (`grpo.reward_funcs`: a directory,
or a registered `models:/name@alias`): its scores against TRL's GRPOTrainer scoring the same
model and rows, what is not a reward model refused in one line, a registered model resolved
to its files (a GRPO run whose only reward is a reward model trained here: the RLHF chain in
tests/test_reward.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT
from test_grpo import prompts  # noqa: F401 (a fixture: the shrunk GRPO example, prepared)

MODEL = ROOT / "data/models/stories260K"
#: the config key the rollout's messages name the entries by
KEY = "grpo.reward_funcs"
#: renders BOS itself, as many chat templates do (a template that does not is given one as
#: a token, as the preference type encodes the reward model's training pairs)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                 "User: {{ m['content'] }}\n{% else %}Assistant: {{ m['content'] }}{{ eos_token }}"
                 "\n{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
PROMPTS = ["Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
           "Question: A box holds 12 eggs. Half break. How many are left?\nAnswer:",
           "Question: Sam reads 5 pages a day for 4 days. Pages?\nAnswer:"]
COMPLETIONS = [" 3 + 4 = 7\n#### 7", " 12 / 2 = 6 eggs are left\n#### 6", " 5 x 4 = 24\n#### 24"]


def _reward_model(path: Path, seed: int = 0) -> Path:
    """A one-output sequence classifier of stories260K's shape, randomly initialised (seeded),
    saved with its tokenizer (and a chat template): what a reward run exports."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(MODEL, num_labels=1)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(path)
    # the tokenizer's files as shipped (a transformers save round trip changes its Metaspace
    # pre-tokenizer's prepend_scheme), and the chat template beside them
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy2(MODEL / name, path / name)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    return _reward_model(tmp_path_factory.mktemp("rm") / "rm")


def _ours(directory: Path, prompts, completions, batch_size=2) -> list[float]:
    from engine.rollout.rewards import RewardOptions, load_reward_functions
    from engine.rollout.scoring import score

    funcs = load_reward_functions([str(directory)], RewardOptions(batch_size=batch_size),
                                  key=KEY)
    assert [f.name for f in funcs] == [directory.name]
    ids = [[0]] * len(completions)
    return score(funcs, prompts, completions, ids, {}, key=KEY)[:, 0].tolist()


def _trls(directory: Path, prompts, completions) -> list[float]:
    """TRL's GRPOTrainer._calculate_rewards with the model as its reward function and the
    tokenizer as its reward processing class (as GRPOTrainer's __init__ prepares them)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(directory)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    model.config.pad_token_id = tok.pad_token_id
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=SimpleNamespace(report_to=[], device=torch.device("cpu"), past_index=-1),
        state=SimpleNamespace(global_step=0), reward_funcs=[model],
        reward_processing_classes=[tok], reward_func_names=["rm"], environments=None,
        chat_template_kwargs={}, is_deepspeed_enabled=False, _log_completion_extra=None,
        _log_metric=None)
    inputs = [{"prompt": p} for p in prompts]
    return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions,
                                          [[0]] * len(prompts))[:, 0].tolist()


def test_string_rows_score_as_trls_on_the_text_the_reward_model_was_trained_on(reward_dir):
    """Strings: BOS, the prompt, the completion, EOS (the preference type's pair rows). TRL
    scores the text it is handed (prompt + completion, no special tokens added), so it is
    handed that text; the scores agree, in chunks of 2 with padding in the last."""
    from transformers import AutoTokenizer

    from engine.rollout.reward_model import RewardModel

    tok = AutoTokenizer.from_pretrained(reward_dir)
    rm = RewardModel(reward_dir, "rm", torch.device("cpu"), 2)
    for p, c in zip(PROMPTS, COMPLETIONS):  # the same text: prompt and completion tokenized
        # apart (as the pairs are) give the ids of the whole (this tokenizer merges across
        # words, so not for every text)
        assert rm.token_ids(p, c) == tok(tok.bos_token + p + c + tok.eos_token,
                                         add_special_tokens=False)["input_ids"]
    ours = _ours(reward_dir, PROMPTS, COMPLETIONS)
    theirs = _trls(reward_dir, [tok.bos_token + p for p in PROMPTS],
                   [c + tok.eos_token for c in COMPLETIONS])
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert len(set(ours)) == 3  # the rows are told apart


def test_conversational_rows_score_as_trls(reward_dir):
    """Conversations: the reward model's tokenizer's chat template over the prompt turns and
    the assistant completion, exactly what TRL's GRPOTrainer scores."""
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c.strip()}] for c in COMPLETIONS]
    ours = _ours(reward_dir, prompts, completions, batch_size=8)
    assert ours == pytest.approx(_trls(reward_dir, prompts, completions), abs=1e-5)
    assert ours != pytest.approx(_ours(reward_dir, PROMPTS, COMPLETIONS), abs=1e-3)


def test_what_is_not_a_reward_model_is_one_line_naming_the_entry(reward_dir, tmp_path):
    from engine.rollout.rewards import RewardOptions, load_reward_functions
    from finetune.errors import PipelineError

    def refused(entry: str) -> str:
        with pytest.raises(PipelineError) as exc:
            load_reward_functions(["format", entry], RewardOptions(), key=KEY)
        assert "\n" not in str(exc.value)
        return str(exc.value)

    two = tmp_path / "two"
    shutil.copytree(reward_dir, two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    assert refused(str(two)) == (f"grpo.reward_funcs[1]: {two} is a sequence classifier with "
                                 "2 outputs; a reward model has one (num_labels 1)")
    assert refused(str(tmp_path / "nothing")).startswith(
        f"grpo.reward_funcs[1]: reward model directory {tmp_path / 'nothing'} not found")
    no_tokenizer = tmp_path / "bare"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((reward_dir / "config.json").read_text())
    assert refused(str(no_tokenizer)) == (f"grpo.reward_funcs[1]: {no_tokenizer} has no "
                                          "tokenizer (save it next to the model)")


# -- a reward model registered in the project's MLflow registry ------------------------------
# (a GRPO run whose only reward is a reward model the reward example trained and registered:
# tests/test_reward.py, the RLHF chain)


def test_a_registered_reward_model_resolves_to_its_files(prompts, reward_dir, tmp_path):
    """A reward model registered (as any model version: a plain directory) and named
    `models:/scorer@champion`: the train stage's resolution downloads its files once into
    data/reward_models/v<version>/<name> and hands the run that directory; a registered model
    that is not there is one line naming the entry."""
    from mlflow.tracking import MlflowClient

    from finetune.errors import PipelineError
    from finetune.workspace import Workspace
    from helpers import write_params
    from tasks import model_refs

    project = tmp_path / "p"
    shutil.copytree(prompts, project, symlinks=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    client.create_registered_model("scorer")
    version = client.create_model_version("scorer", str(reward_dir)).version
    client.set_registered_model_alias("scorer", "champion", version)
    write_params(project, {"grpo.reward_funcs": ["format", "models:/scorer@champion"]})
    ws = model_refs.resolved(Workspace.load(project / "params/default.yaml"))
    assert ws.config.grpo.reward_funcs == ["format", "data/reward_models/v1/scorer"]
    assert (project / "data/reward_models/v1/scorer/config.json").exists()
    assert _ours(project / ws.config.grpo.reward_funcs[1], PROMPTS, COMPLETIONS) == \
        pytest.approx(_ours(reward_dir, PROMPTS, COMPLETIONS), abs=1e-6)

    write_params(project, {"grpo.reward_funcs": ["format", "models:/scorer@nobody"]})
    ws = Workspace.load(project / "params/default.yaml")
    with pytest.raises(PipelineError) as missing:
        model_refs.check(ws)
    assert str(missing.value).startswith(
        "grpo.reward_funcs[1] 'models:/scorer@nobody': not in the model registry at sqlite:")
    assert "\n" not in str(missing.value)


def test_validate_refuses_a_directory_that_is_not_a_reward_model(prompts, tmp_path):
    """`finetune validate` (nothing is trained): exit 2, one line naming the entry."""
    from helpers import run_cli, write_params

    project = tmp_path / "p"
    shutil.copytree(prompts, project, symlinks=True)
    write_params(project, {"grpo.reward_funcs": ["format", "data/models/stories260K"],
                           "grpo.reward_weights": None})
    proc = run_cli(project, "validate")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "error: grpo.reward_funcs[1]: data/models/stories260K is not a reward model (a "
        "sequence classifier with one output); its config's architectures: "
        "['LlamaForCausalLM']"), proc.stderr

    # a registered model where no registry is yet: one line, and no database made by asking
    from finetune.errors import PipelineError
    from finetune.workspace import Workspace
    from tasks.checks import check_model_refs

    assert not (project / "mlflow.db").exists()
    write_params(project, {"grpo.reward_funcs": ["models:/rm/3"],
                           "registry.gate_metric": "eval.reward_rm"})
    with pytest.raises(PipelineError) as missing:
        check_model_refs(Workspace.load(project / "params/default.yaml"))
    assert str(missing.value) == (
        f"grpo.reward_funcs[0] 'models:/rm/3': not in the model registry at "
        f"sqlite:///{project / 'mlflow.db'} (there is no MLflow database yet: register the "
        "reward model first)")
    assert not (project / "mlflow.db").exists()
