"""Distillation against TRL's GKDTrainer (trl.experimental.gkd) as the oracle: the same
student, teacher and rows give the same loss and gradients (within 1e-5) for beta 0 (forward
KL), 0.5 and 1 (reverse KL), with our chunked loss (the output layer applied a few target rows
at a time, never the whole batch's logits) and lmbda 1 (TRL samples, its samples injected: the
same completions trained on with the same masks); at another temperature the same as TRL's
generalized_jsd_loss; the offline loss over the teacher's top-k equals the full-vocabulary
loss when top_k is the vocabulary size, and differs from it below."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.recipe.distill.loss import DistillLoss, Teacher, Weights, chunked_sum, log_probs
from engine.recipe.distill.teacher import TeacherRows
from engine.objective.loss import target_rows

trl = pytest.importorskip("trl")
gkd = pytest.importorskip("trl.experimental.gkd")

MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "stories260K"


@pytest.fixture(scope="module")
def pair():
    """(student, teacher, tokenizer): the shipped tiny model and a copy with seeded noise on
    every weight, so their distributions differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    student = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    teacher = copy.deepcopy(student)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp_min(1e-3))
    return student, teacher, tok


def rows(tok) -> dict[str, torch.Tensor]:
    """Two right-padded rows, prompts unlabelled."""
    texts = [("Once upon a time", " there was a little dog named Tom."),
             ("Lily liked", " to play.")]
    ids, labels = [], []
    for prompt, completion in texts:
        p, c = tok(prompt)["input_ids"], tok(completion, add_special_tokens=False)["input_ids"]
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    n = max(map(len, ids))
    batch = {"input_ids": torch.full((2, n), tok.pad_token_id),
             "attention_mask": torch.zeros(2, n, dtype=torch.long),
             "labels": torch.full((2, n), -100)}
    for i, (x, y) in enumerate(zip(ids, labels)):
        batch["input_ids"][i, :len(x)] = torch.tensor(x)
        batch["attention_mask"][i, :len(x)] = 1
        batch["labels"][i, :len(y)] = torch.tensor(y)
    return batch


@pytest.fixture(scope="module")
def built(pair, tmp_path_factory):
    """One GKDTrainer for the module (building one is most of a test's time): each test puts
    the student's weights back and sets its beta."""
    student, teacher, tok = pair
    return gkd_trainer(tmp_path_factory.mktemp("trl"), copy.deepcopy(student),
                       copy.deepcopy(teacher), tok, 0.5)


def with_beta(trainer, student, beta: float):
    trainer.model.load_state_dict(student.state_dict())
    trainer.model.zero_grad(set_to_none=True)
    trainer.beta = beta
    return trainer


def gkd_trainer(tmp_path, student, teacher, tok, beta: float, lmbda: float = 0.0):
    import datasets

    args = gkd.GKDConfig(output_dir=str(tmp_path / "trl"), beta=beta, lmbda=lmbda,
                         temperature=1.0, report_to=[], use_cpu=True, bf16=False,
                         max_steps=1, save_strategy="no", per_device_train_batch_size=2,
                         max_new_tokens=6)
    data = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "x"}]]})
    trainer = gkd.GKDTrainer(model=student, teacher_model=teacher, args=args,
                             train_dataset=data, processing_class=tok)
    trainer.model.train()
    return trainer


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return out


def ours(student, teacher, batch, beta: float, temperature: float = 1.0,
         chunk_tokens: int | None = 3, alpha: float = 0.0) -> tuple[torch.Tensor, list]:
    """Our loss (summed over the trained tokens, over their count: TRL's reduction) and the
    student's gradients, the teacher's side its hidden states at the target rows."""
    student = copy.deepcopy(student)
    student.train()
    loss = DistillLoss(student, Weights(beta, temperature, alpha), chunk_tokens,
                       torch.device("cpu"))
    scorer = TeacherRows(copy.deepcopy(teacher))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    hidden = scorer.hidden_at(inputs, batch["labels"])
    with loss.computing(batch["labels"], Teacher(hidden=hidden, head=scorer.head)):
        summed = loss.loss_sum(student(**inputs, use_cache=False))
    n = len(target_rows(batch["labels"])[0])
    (summed / n).backward()
    return (summed / n).detach(), grads(student)


def assert_close(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(float(loss_a) - float(loss_b)) <= 1e-5, (float(loss_a), float(loss_b))
    assert len(grads_a) == len(grads_b)
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradients_equal_gkd_trainers(pair, built, beta):
    student, teacher, tok = pair
    batch = rows(tok)
    trainer = with_beta(built, student, beta)
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    theirs.backward()
    expected = (theirs.detach(), grads(trainer.model))
    assert float(expected[0]) > 1e-4  # the two models differ: a loss that can fail
    assert_close(ours(student, teacher, batch, beta), expected)
    # the same in one chunk (all target rows at once)
    assert_close(ours(student, teacher, batch, beta, chunk_tokens=None), expected)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_on_policy_step_equals_gkd_trainers_with_injected_samples(pair, built, beta,
                                                                  monkeypatch):
    """lmbda 1: TRL replaces the batch by the student's samples (its generate injected here,
    with an EOS in one row), masks the prompt and what follows the EOS; our loss on the same
    samples, with our masks, gives its loss and gradients."""
    student, teacher, tok = pair
    batch = rows(tok)
    prompt = batch["input_ids"][:, :4]
    g = torch.Generator().manual_seed(3)
    completion = torch.randint(5, 400, (2, 6), generator=g)
    completion[0, 2] = tok.eos_token_id  # row 0 ends early
    sequences = torch.cat([prompt, completion], dim=1)

    class Generated:
        def __init__(self):
            self.sequences = sequences

    trainer = with_beta(built, student, beta)
    monkeypatch.setattr(type(trainer.model), "generate",
                        lambda self, **kw: Generated(), raising=False)
    inputs = {"prompts": prompt, "prompt_attention_mask": torch.ones_like(prompt),
              **batch}
    new_ids, new_mask, new_labels = trainer.generate_on_policy_outputs(
        trainer.model, inputs, trainer.generation_config)
    theirs = trainer.compute_loss(trainer.model, {"input_ids": new_ids,
                                                  "attention_mask": new_mask,
                                                  "labels": new_labels})
    theirs.backward()
    expected = (theirs.detach(), grads(trainer.model))

    from engine.recipe.distill.sampling import completion_batch

    mine = completion_batch(prompt, torch.ones_like(prompt), completion, tok.eos_token_id)
    assert torch.equal(mine["labels"], new_labels)
    assert torch.equal(mine["attention_mask"], new_mask)
    assert_close(ours(student, teacher, mine, beta), expected)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_temperature_equals_trls_generalized_jsd(pair, beta):
    student, teacher, tok = pair
    batch = rows(tok)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    s = copy.deepcopy(student)
    with torch.no_grad():
        t_logits = teacher(**inputs).logits[:, :-1]
    theirs = gkd.GKDTrainer.generalized_jsd_loss(s(**inputs).logits[:, :-1], t_logits,
                                                 labels=batch["labels"][:, 1:], beta=beta,
                                                 temperature=2.0)
    theirs.backward()
    assert_close(ours(student, teacher, batch, beta, temperature=2.0),
                 (theirs.detach(), grads(s)))


def offline_loss(student, teacher, batch, beta, top_k, temperature=1.0):
    """(loss, grads) from the teacher's top-k ids and log-probs (what the teacher stage
    stores), full-vocabulary log-softmax at temperature."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    rows_, targets = target_rows(batch["labels"])
    with torch.no_grad():
        t = log_probs(teacher(**inputs).logits.reshape(-1, teacher.config.vocab_size)[rows_],
                      temperature)
    logps, ids = t.topk(top_k, dim=-1)
    s = copy.deepcopy(student)
    hidden = s.model(**inputs).last_hidden_state.reshape(-1, s.config.hidden_size)
    summed = chunked_sum(s.lm_head, hidden, rows_, targets, Teacher(ids=ids, logps=logps),
                         Weights(beta, temperature), chunk_tokens=4)
    (summed / len(rows_)).backward()
    return (summed / len(rows_)).detach(), grads(s)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_offline_top_k_equals_full_vocabulary_loss_at_vocabulary_size(pair, beta):
    student, teacher, tok = pair
    batch = rows(tok)
    full = ours(student, teacher, batch, beta, temperature=1.5)
    assert_close(offline_loss(student, teacher, batch, beta, teacher.config.vocab_size, 1.5),
                 full)
    # a few ids only: another loss (so the test above can fail)
    truncated = offline_loss(student, teacher, batch, beta, 4, 1.5)
    assert abs(float(truncated[0]) - float(full[0])) > 1e-4
