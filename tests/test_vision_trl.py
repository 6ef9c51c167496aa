"""Our vision SFT against TRL 1.16's SFTTrainer (the oracle), for two families: the shipped tiny
LLaVA and the Qwen2-VL of tests/test_vision_qwen2vl.py (its grids and token types compared
too), on the shipped rows of drawn squares: TRL's own collator (DataCollatorForVisionLanguageModeling, with
assistant_only_loss and a copy of the model's chat template with TRL's `{% generation %}`
markers around what our chat type trains of the assistant's turn) builds
a batch from the raw rows and PIL images; ours comes from the tokenize stage's rows through the
model kind's collate. The batches are the same tensors (ids, attention, labels, pixel values:
the image tokens untrained on both sides), and TRL's `compute_loss` on its batch equals our
training step's (TrainingRun.micro_step with the kind's loss) on ours, in value and in every
parameter's gradient.

TRL's default for a `messages` row without assistant_only_loss trains the image placeholder
tokens too (its labels mask padding only); we never train them, so the oracle runs TRL in the
mode that agrees with the issue's rule (labels of image tokens are -100).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY, copy_project, resolve_example, stages_here

from preprocess.vlm_shapes import MARKED_TEMPLATE

#: Qwen2-VL's template (tests/test_vision_qwen2vl.py) with the markers: its tokenizer adds no
#: BOS, and the trained span is the answer, <|im_end|> and the newline
QWEN_TRL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}"
    "{% endgeneration %}{% else %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROWS = 4
#: family -> (its model folder in the project, the template TRL's collator renders with)
FAMILIES = {"llava": ("data/models/tiny-llava", MARKED_TEMPLATE),
            "qwen2vl": ("data/models/tiny-qwen2vl", QWEN_TRL_TEMPLATE)}


def family_project(tmp_path_factory, family: str, example: str) -> Path:
    """A project of `example` on the family's model (Qwen2-VL's built here), tokenized."""
    project = copy_project(tmp_path_factory.mktemp(f"vision_trl_{family}") / "p")
    overrides = {**TINY, "data.max_train_samples": 8, "data.max_eval_samples": 4}
    if family == "qwen2vl":
        from test_vision_qwen2vl import image_only_processor, tiny_qwen2vl

        image_only_processor()
        tiny_qwen2vl(project / FAMILIES[family][0])
        overrides["model.name_or_path"] = FAMILIES[family][0]
    resolve_example(project, example, overrides)
    stages_here(project, "download", "format", "tokenize")
    return project


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tokenized(request, tmp_path_factory) -> tuple[Path, str]:
    return family_project(tmp_path_factory, request.param, "params/vlm-shapes.yaml"), \
        request.param


def test_the_batch_loss_and_gradients_are_trls(tokenized):
    import datasets
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from engine.datapath.data import collate, count_targets
    from engine.kinds.image_text_to_text import ImageTextToText
    from engine.modeling.model import choose_pad_token
    from engine.recipe.run import TrainingRun
    from finetune.workspace import Workspace

    project, family = tokenized
    folder, template = FAMILIES[family]
    model_dir = project / folder
    processor = AutoProcessor.from_pretrained(model_dir)
    if processor.tokenizer.pad_token is None:  # the pad token our runs choose
        processor.tokenizer.pad_token = choose_pad_token(processor.tokenizer)
    source = project / "data/source/shapes"
    raw = [json.loads(line) for line in (source / "train.jsonl").read_text().splitlines()]
    tokenized_rows = datasets.load_from_disk(str(project / "data/tokenized/train"))
    rows = [tokenized_rows[i] for i in range(ROWS)]  # the raw rows' order (no shuffle)

    # TRL's side: its collator on the raw rows and their images
    trl_rows = []
    for r in raw:
        images = [Image.open(source / p).convert("RGB") for p in r["images"]]
        trl_rows.append({"messages": r["messages"], "images": images})
    collator = DataCollatorForVisionLanguageModeling(processor=processor, max_length=None,
                                                     assistant_only_loss=True,
                                                     chat_template=template)
    theirs = collator([dict(r) for r in trl_rows[:ROWS]])

    # ours: the tokenize stage's rows through the model kind's collate
    cfg = Workspace.load(project / "params/default.yaml").config
    kind = ImageTextToText()
    pad = processor.tokenizer.pad_token_id
    ours = kind.train_collate(cfg, None, pad, lambda r: collate(r, pad_id=pad))(rows)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert torch.equal(ours["labels"], theirs["labels"])
    image = processor.image_token_id
    assert int((ours["input_ids"] == image).sum()) == 16 * ROWS
    assert not bool((ours["labels"] == image).any())
    torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"], rtol=0, atol=1e-6)
    for key in ("image_grid_thw", "mm_token_type_ids"):  # Qwen2-VL's
        assert (key in ours) == (key in theirs) and (
            key not in ours or torch.equal(ours[key], theirs[key])), key

    # TRL's loss (its fused LM head, normalised by the batch's target tokens) and gradients
    trainer = SFTTrainer(
        model=AutoModelForImageTextToText.from_pretrained(model_dir),
        args=SFTConfig(output_dir=str(project / "trl"), use_cpu=True, report_to=[],
                       max_length=None, bf16=False),  # the batch is the collator's above
        train_dataset=datasets.Dataset.from_list(trl_rows), processing_class=processor)
    policy = trainer.model
    policy.train()
    loss = trainer.compute_loss(policy, dict(theirs))
    loss.backward()
    their_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    # ours: one micro-step of the SFT run with the kind's loss (chunked, as trained)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).train()
    run = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device("cpu")), amp=None,
                          model=model, scaler=None,
                          loss=kind.loss(model, cfg, torch.device("cpu"), None))
    divisor = count_targets(ours)
    loss_sum = TrainingRun.micro_step(run, ours["labels"], ours, divisor)
    assert float(loss_sum / divisor) == pytest.approx(float(loss.detach()), abs=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == their_grads.keys() and len(grads) > 20
    for name, grad in grads.items():
        torch.testing.assert_close(grad, their_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert max(g.abs().max() for g in grads.values()) > 1e-3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pairs_tokenized(request, tmp_path_factory) -> tuple[Path, str]:
    return family_project(tmp_path_factory, request.param, "params/vlm-shapes-dpo.yaml"), \
        request.param


def test_dpo_with_images_batch_and_loss_are_trls(pairs_tokenized, tmp_path):
    """TRL's DataCollatorForVisionPreference on the raw pairs and their PIL images gives our
    pairs' batch (both sides' ids and what is trained, each pair's pixel values for both
    sides), and TRL's DPOTrainer._compute_loss on it (a perturbed policy against the base as
    the reference, sigmoid, beta 0.1) equals our preference loss on ours, with the same
    logged statistics, within 1e-5."""
    import copy

    import datasets
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from engine.datapath.data import collate, model_inputs
    from engine.kinds.image_text_to_text import ImageTextToText
    from engine.modeling.model import choose_pad_token
    from engine.objective.logprobs import sequence_logps
    from engine.recipe.dpo.batches import collate_pairs
    from engine.recipe.dpo.loss import logged, preference_loss
    from finetune.config.preference import DPOConfig as OurDPO
    from finetune.workspace import Workspace

    project, family = pairs_tokenized
    model_dir = project / FAMILIES[family][0]
    processor = AutoProcessor.from_pretrained(model_dir)
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = choose_pad_token(processor.tokenizer)
    source = project / "data/source/shapes"
    raw = [json.loads(line) for line in
           (source / "pairs-train.jsonl").read_text().splitlines()][:ROWS]
    trl_rows = [{**r, "images": [Image.open(source / p).convert("RGB") for p in r["images"]]}
                for r in raw]
    if family == "llava":  # our encoding adds the tokenizer's BOS; TRL's leaves it to the
        processor.chat_template = "{{ bos_token }}" + processor.chat_template  # template
    theirs = DataCollatorForVisionPreference(processor=processor)(copy.deepcopy(trl_rows))

    cfg = Workspace.load(project / "params/default.yaml").config
    kind = ImageTextToText()
    pad = processor.tokenizer.pad_token_id
    rows = datasets.load_from_disk(str(project / "data/tokenized/train"))
    ours = collate_pairs([rows[i] for i in range(ROWS)], kind.train_collate(
        cfg, None, pad, lambda r: collate(r, pad_id=pad)))
    # the same tokens, and the same ones trained (TRL's completion_mask, our labels)
    for i in range(2 * ROWS):
        mine = ours["input_ids"][i][ours["attention_mask"][i].bool()]
        their = theirs["input_ids"][i][theirs["attention_mask"][i].bool()]
        assert mine.tolist() == their.tolist(), (processor.tokenizer.decode(mine),
                                                 processor.tokenizer.decode(their))
        trained = ours["labels"][i][ours["attention_mask"][i].bool()] != -100
        assert trained.tolist() == theirs["completion_mask"][i][
            theirs["attention_mask"][i].bool()].bool().tolist(), i
    torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"], rtol=0, atol=1e-6)

    ref = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    policy = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref),
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[],
                                        use_cpu=True, bf16=False, beta=0.1,
                                        per_device_train_batch_size=ROWS, max_length=None),
                         processing_class=processor,
                         train_dataset=datasets.Dataset.from_list(trl_rows))
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, theirs, return_outputs=False)
    stats = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    dpo = OurDPO(beta=0.1, loss_type="sigmoid")
    inputs = model_inputs(ours)
    logps, counts = sequence_logps(policy.train()(**inputs).logits, ours["labels"])
    with torch.no_grad():
        ref_logps = sequence_logps(ref(**inputs).logits, ours["labels"])[0]
    out = preference_loss(dpo, logps, counts, ref_logps, None)
    assert float(out.losses.mean()) == pytest.approx(float(loss), abs=1e-5)
    mine = {name: float(v) / ROWS for name, v in zip(logged(dpo), out.sums())}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        assert mine[name] == pytest.approx(stats[name], abs=1e-5 * max(1.0, abs(mine[name]))), \
            name
    assert abs(mine["rewards/margins"]) > 1e-4  # the perturbation moved the policy
