"""Every option does what it says or is refused: the valid configs that silently did something
else, or crashed in a worker, found by reading the code against the seeds."""

from __future__ import annotations

import ast

import pytest
import torch
from helpers import BASE, ROOT, logged_column, losses, train_here, train_metrics

from finetune.config.data import DataConfig
from finetune.config.evaluation import EvalConfig
from finetune.config.schema import FinetuneConfig
from finetune.errors import PipelineError

DATA = {"json_file_path": "x.jsonl"}


def test_a_seed_outside_numpys_range_is_refused_when_validated():
    for key, section in (("seed", "training"), ("seed", "data")):
        with pytest.raises(ValueError, match=f"{section}.{key}\n.*greater than or equal to 0"):
            FinetuneConfig.model_validate({"data": DATA, section: {key: -2}})
        with pytest.raises(ValueError, match="less than or equal to 4294967295"):
            FinetuneConfig.model_validate({"data": DATA, section: {key: 2**32}})


def test_training_seed_minus_one_is_the_seeds_do_not_seed():
    """QEfficient's seed -1 ('do not seed') is our null: the train stage draws and logs one."""
    unseeded = FinetuneConfig.model_validate({"data": DATA, "training": {"seed": -1}})
    assert unseeded.training.seed is None
    assert unseeded.model_dump() == FinetuneConfig.model_validate(
        {"data": DATA, "training": {"seed": None}}).model_dump()
    with pytest.raises(ValueError, match="data.seed\n.*greater than or equal to 0"):
        FinetuneConfig.model_validate({"data": {**DATA, "seed": -1}})  # the split is seeded


def test_the_seeds_null_and_zero_meanings():
    """Seed 004's target_column: null means no classification; seed 001's eval_batches > 0
    turns in-training evaluation on, so 0 means none, and -1 (max_eval_steps) all batches."""
    assert DataConfig(**DATA, target_column=None).label_column is None
    with pytest.raises(ValueError, match="label_column .target_column. is null; a "
                       "classification dataset names the column"):
        DataConfig(**DATA, dataset_type="classification", target_column=None)
    assert EvalConfig(eval_batches=0).effective_eval_strategy == "no"
    assert EvalConfig(eval_batches=-1).eval_batches is None
    assert EvalConfig(max_eval_steps=-1, eval_strategy="steps").effective_eval_strategy == "steps"
    # > 0 alone turns it on (every eval_steps); an eval_strategy the file sets wins
    assert EvalConfig(max_eval_steps=3).effective_eval_strategy == "steps"
    assert EvalConfig(max_eval_steps=3, eval_strategy="no").effective_eval_strategy == "no"
    assert EvalConfig().effective_eval_strategy == "no"
    assert EvalConfig(eval_batches=0, eval_on_save=True).evaluates_in_training is False


def test_a_text_field_next_to_templates_is_refused_not_ignored():
    with pytest.raises(ValueError, match="text_field names the column trained on when no "
                       "template is set"):
        DataConfig(**DATA, text_field="body", prompt_template="Q: {q}",
                   completion_template=" {a}")
    assert DataConfig(**DATA, text_field="body").datatype.required_columns() == ["body"]


def test_group_by_length_over_a_token_column_and_no_evaluation_at_eval_batches_0(tokenized,
                                                                                 tmp_path):
    """Seed 004's length_column_name: input_ids (a list column) groups by its lengths, as the
    length column does; eval_batches 0 evaluates nothing during training, not even at the
    saves eval_on_save asks to evaluate at."""
    common = {**BASE, "training.group_by_length": True, "eval.eval_batches": 0,
              "eval.eval_strategy": "steps", "eval.eval_steps": 2, "eval.eval_on_save": True,
              "checkpoint.save_strategy": "steps", "checkpoint.save_steps": 2}
    ids, _ = train_here(tokenized, tmp_path / "ids", {
        **common, "training.length_column_name": "input_ids"})
    length, _ = train_here(tokenized, tmp_path / "length", common)
    assert losses(ids) == losses(length)
    assert not (ids / "data/plots/eval.csv").exists() or logged_column(ids, "step", "eval.csv") == []
    assert "eval_loss" not in train_metrics(ids)


USER_OUTER = """
import torch


class CountingSGD(torch.optim.SGD):
    def step(self, closure=None):
        with open("outer_steps.txt", "a") as fh:
            fh.write("x")
        return super().step(closure)
"""


def test_diloco_takes_its_outer_optimizer_by_reference_as_optimizer_name_does(tokenized,
                                                                             tmp_path):
    """distributed.diloco.outer_optimizer as 'module:Class' (as optimizer.name takes it):
    torch.optim:SGD is SGD itself (one config, so one run and one fingerprint), and a
    project's class runs each outer step."""
    import shutil

    diloco = {"distributed": {"strategy": "diloco", "diloco": {
        "inner_steps": 2, "diloco_loops": 2, "outer_optimizer": "torch.optim:SGD"}}}
    named = FinetuneConfig.model_validate({"data": DATA, **diloco})
    plain = FinetuneConfig.model_validate({"data": DATA, "distributed": {
        "strategy": "diloco", "diloco": {"inner_steps": 2, "diloco_loops": 2}}})
    assert named.model_dump() == plain.model_dump()
    src = tmp_path / "src"
    shutil.copytree(tokenized, src, symlinks=True)
    (src / "user_outer.py").write_text(USER_OUTER)
    user, _ = train_here(src, tmp_path / "user", {
        **BASE, "training.max_steps": 4, "eval.eval_steps": 2,
        "distributed.strategy": "diloco", "distributed.diloco.inner_steps": 2,
        "distributed.diloco.diloco_loops": 2,
        "distributed.diloco.outer_optimizer": "user_outer:CountingSGD"})
    assert (user / "outer_steps.txt").read_text() == "xx"  # one step per outer loop


def test_the_pipeline_compiles_and_computes_its_loss_through_the_shared_functions():
    """The pipeline's stages are compiled by the one function that reads every compile option
    (engine.modeling.compile.compile_part) and its loss is the public, chunk-honouring one; nothing
    else in the engine calls torch.compile or a private loss helper."""
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) == "torch.compile"]
        # attention.py compiles FlexAttention's kernel function (no eager fast path on CUDA),
        # not a module of the model
        if path.name not in ("compile.py", "attention.py"):
            assert calls == [], path
        private = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module and n.module.startswith("engine") for a in n.names
                   if a.name.startswith("_")]
        assert private == [], (path, private)


def test_the_head_loss_honours_loss_chunk_tokens():
    from engine.objective.loss import head_loss_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 11)
    calls = []

    def counted(x):
        calls.append(len(x))
        return head(x)

    hidden = torch.randn(2, 5, 4)
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, 5, 6, 7]])  # 7 targets
    whole = head_loss_sum(counted, hidden, labels, None)
    assert calls == [7]
    chunked = head_loss_sum(counted, hidden, labels, 3)
    assert calls[1:] == [3, 3, 1]
    assert torch.allclose(whole, chunked)
    logits = head(hidden)[:, :-1].reshape(-1, 11)
    expected = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1),
                                                 reduction="sum")
    assert torch.allclose(whole, expected)


def test_the_pipeline_refuses_a_loss_function_of_full_logits():
    with pytest.raises(ValueError, match="training.compute_loss_func: m:f does not combine "
                       "with distributed.strategy pipeline"):
        FinetuneConfig.model_validate({"data": DATA, "training": {"compute_loss_func": "m:f"},
                                       "distributed": {"strategy": "pipeline",
                                                       "nproc_per_node": 2}})


def test_compile_part_reads_every_compile_option():
    from torch._dynamo import reset

    from engine.modeling.compile import compile_part
    from finetune.config.training import TrainingConfig

    seen = []

    def backend(gm, inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.register_backend(backend, name="counting_for_test")
    try:
        layers = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3))
        t = TrainingConfig(torch_compile=True, torch_compile_backend="counting_for_test",
                           torch_compile_scope="blocks")
        compile_part(layers, t, {"Linear"})  # the "blocks": each Linear on its own
        layers(torch.randn(2, 3))
        assert len(seen) == 2
        whole = compile_part(torch.nn.Sequential(torch.nn.Linear(3, 3)), t.model_copy(
            update={"torch_compile_scope": "model"}), set())
        whole(torch.randn(2, 3))
        assert len(seen) == 3
    finally:
        reset()
    with pytest.raises(PipelineError, match="names no decoder block class"):
        compile_part(torch.nn.Linear(2, 2), TrainingConfig(torch_compile=True), set())


@pytest.mark.parametrize("section, alias, own, value", [
    ("data", "target_column", "label_column", "label"),
    ("eval", "max_eval_steps", "eval_batches", 2),
    ("model", "tokenizer_name", "tokenizer_name_or_path", "tok"),
])
def test_an_alias_next_to_its_own_name_is_one_line_saying_keep_one(section, alias, own, value):
    """The seed's names are aliases (pydantic's validation_alias); a file that sets both the
    alias and our name is told so, not sent to a near-named key elsewhere."""
    from finetune.config.loader import validate_raw

    raw = {"data": dict(DATA)}
    raw.setdefault(section, {}).update({own: value, alias: value})
    with pytest.raises(PipelineError) as err:
        validate_raw(raw)
    assert str(err.value) == (f"<params>: `{section}.{alias}` is an alias of `{section}.{own}`, "
                              "which the file also sets; keep one")


def test_diloco_outer_momentum_goes_to_sgd_by_its_class_not_its_name():
    """outer_momentum/outer_nesterov reach SGD however it is named (torch.optim.sgd:SGD is SGD,
    a subclass is SGD); set for another class they are refused in one line, not dropped."""
    from finetune.config.distributed import DilocoConfig

    for ref in ("SGD", "torch.optim:SGD", "torch.optim.sgd:SGD"):
        assert DilocoConfig(inner_steps=2, outer_optimizer=ref).outer_optimizer == "SGD"

    class MySGD(torch.optim.SGD):
        pass

    c = DilocoConfig(inner_steps=2, outer_optimizer="user:MySGD", outer_momentum=0.5)
    assert c.outer_optimizer_kwargs(MySGD) == {"lr": 0.7, "momentum": 0.5, "nesterov": True}
    assert DilocoConfig(inner_steps=2, outer_optimizer="Adam").outer_optimizer_kwargs(
        torch.optim.Adam) == {"lr": 0.7}
    with pytest.raises(PipelineError, match="^distributed.diloco.outer_nesterov applies to SGD, "
                       "and outer_optimizer 'Adam' is Adam; remove it"):
        DilocoConfig(inner_steps=2, outer_optimizer="Adam",
                     outer_nesterov=False).outer_optimizer_kwargs(torch.optim.Adam)
    # before launch (finetune validate, the train stage), not in a worker
    from engine.preflight import check_user_code_and_machine

    cfg = FinetuneConfig.model_validate({"data": DATA, "distributed": {
        "strategy": "diloco", "diloco": {"inner_steps": 2, "outer_optimizer": "torch.optim:Adam",
                                         "outer_momentum": 0.5}}})
    with pytest.raises(PipelineError, match="^distributed.diloco.outer_momentum applies to SGD"):
        check_user_code_and_machine(cfg, torch.device("cpu"))


def test_the_seeds_collator_name_is_ours_and_loads_no_user_code(monkeypatch):
    """QEfficient's collate_fn: dynamic_padding (also as HF's data_collator) is our padding:
    no user code to load before launch, pad_to_multiple_of applies; a near name is refused."""
    from engine.preflight import check_user_code_and_machine

    for key in ("collate_fn", "data_collator"):
        cfg = FinetuneConfig.model_validate({"data": {**DATA, key: "dynamic_padding"},
                                             "training": {"pad_to_multiple_of": 8}})
        assert cfg.data.collate_fn == "dynamic_padding" and cfg.data.user_collate_fn is None
        check_user_code_and_machine(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="'dynamic' is neither a 'module:function' of the "
                       "project nor a collator's name: dynamic_padding \\(did you mean"):
        DataConfig(**DATA, collate_fn="dynamic")
