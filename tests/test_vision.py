"""Images in (issue 69): the `vision_chat` dataset type and the `image_text_to_text` model kind
on a tiny LLaVA built here from config (random weights; its processor assembled from the
shipped stories260K tokenizer and a CLIP image-processor config: nothing downloaded), on rows
whose images are drawn with Pillow (a count of squares).

The checks: an image's tokens are the processor's (16 per 32x32 image, patch 8) and never
trained, the assistant turn is; the batch carries the pixel values in row order; a missing or
unreadable image and a count that does not match the image parts are one line naming the row
and the file; a text chat row with an image part is refused; the six stages run and the
export loads with AutoModelForImageTextToText and AutoProcessor and generates from an image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (TINY, copy_project, logged_column, resolve_example, stages_here,
                     train_in_place, write_params)

from finetune.errors import PipelineError

from preprocess.vlm_shapes import IMAGE_TOKENS, TEMPLATE, write_rows


#: the shipped example (params/vlm-shapes.yaml, made by preprocess/vlm_shapes.py), shrunk
VISION = {**TINY, "data.max_train_samples": 32, "data.max_eval_samples": 8,
          "training.max_steps": 8, "checkpoint.save_steps": 4, "eval.eval_steps": 4}


@pytest.fixture(scope="module")
def vision_project(tmp_path_factory) -> Path:
    project = copy_project(tmp_path_factory.mktemp("vision") / "p")
    resolve_example(project, "params/vlm-shapes.yaml", VISION)
    stages_here(project, "download", "format", "tokenize")
    return project


def test_image_tokens_are_the_processors_and_never_trained(vision_project):
    import datasets
    from transformers import AutoProcessor

    ds = datasets.load_from_disk(str(vision_project / "data/tokenized/train"))
    processor = AutoProcessor.from_pretrained(vision_project / "data/models/tiny-llava")
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert len(ds) == 32
    for row in ds.select(range(4)):
        ids, labels = row["input_ids"], row["labels"]
        at = [k for k, t in enumerate(ids) if t == image]
        assert len(at) == IMAGE_TOKENS and at == list(range(at[0], at[0] + IMAGE_TOKENS))
        assert all(labels[k] == -100 for k in at)
        trained = [t for t, lab in zip(ids, labels) if lab != -100]
        text = processor.tokenizer.decode(trained)
        assert text.strip().rstrip("</s>").strip() in "1234" and "</s>" in text, text
        assert row["pixel_shape"] == [1, 3, 32, 32]
        assert len(row["pixel_values"]) == 3 * 32 * 32
    # the processor's own pixel values for the row's image
    from PIL import Image

    first = json.loads((vision_project / "data/source/shapes/train.jsonl").read_text()
                       .splitlines()[0])
    pixels = processor.image_processor(Image.open(vision_project / "data/source/shapes" /
                                                  first["images"][0]).convert("RGB"),
                                       return_tensors="np")["pixel_values"]
    assert torch.allclose(torch.tensor(ds[0]["pixel_values"]),
                          torch.from_numpy(pixels.ravel()), atol=1e-6)


def test_a_batch_stacks_each_rows_pixels_in_row_order(vision_project):
    import datasets

    from engine.kinds.image_text_to_text import collate_with_images
    from engine.datapath.data import collate

    ds = datasets.load_from_disk(str(vision_project / "data/tokenized/train"))
    rows = [ds[i] for i in range(3)]
    batch = collate_with_images(rows, lambda r: collate(r, pad_id=0))
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    for i, row in enumerate(rows):
        assert torch.equal(batch["pixel_values"][i].reshape(-1),
                           torch.tensor(row["pixel_values"], dtype=torch.float32))


def _format_error(project: Path, rows: list[dict]) -> str:
    write_rows(project / "data/source/shapes/train.jsonl", rows)
    stages_here(project, "download")
    with pytest.raises(PipelineError) as refused:
        stages_here(project, "format")
    return str(refused.value)


def test_a_missing_or_unreadable_image_or_a_wrong_count_is_one_line(vision_project, tmp_path):
    import shutil

    project = tmp_path / "p"
    shutil.copytree(vision_project, project, symlinks=True)
    source = project / "data/source/shapes"
    rows = [json.loads(line) for line in (source / "train.jsonl").read_text().splitlines()]
    assert _format_error(project, [rows[0], {**rows[1], "images": ["images/nowhere.png"]}]) == (
        f"split 'train' row 1 column 'images' image 0: {source / 'images/nowhere.png'} not found")
    (source / "images/broken.png").write_bytes(b"not a png")
    said = _format_error(project, [{**rows[0], "images": ["images/broken.png"]}])
    assert said.startswith(f"split 'train' row 0 column 'images' image 0: "
                           f"{source / 'images/broken.png'} is not a readable image"), said
    said = _format_error(project, [{**rows[0], "images": []}])
    assert said == ("split 'train' row 0 column 'images': 0 images for 1 image parts in the "
                    "messages; give one image per {\"type\": \"image\"}")


def test_a_text_chat_row_with_an_image_part_is_refused(vision_project, tmp_path):
    import shutil

    project = tmp_path / "p"
    shutil.copytree(vision_project, project, symlinks=True)
    write_params(project, {"data.dataset_type": "chat", "data.chat_template": TEMPLATE,
                           "model.auto_class_name": "AutoModelForCausalLM",
                           "model.name_or_path": "data/models/stories260K"})
    stages_here(project, "download")
    with pytest.raises(PipelineError, match=r"split '(train|test)' row 0 column 'messages': an image "
                       r"part; data.dataset_type chat trains text alone"):
        stages_here(project, "format")


def _open_training_run(project: Path) -> None:
    """What the train stage does besides training, for an in-process run: the run's MLflow
    run (tasks.tracking.start_run) named in data/lineage/train_run.json."""
    from finetune.workspace import Workspace
    from tasks import tracking

    ws = Workspace.load(project / "params/default.yaml")
    run_id = tracking.start_run(ws)
    ws.layout.train_run.parent.mkdir(parents=True, exist_ok=True)
    ws.layout.train_run.write_text(json.dumps({"mlflow_run_id": run_id}))


def test_the_six_stages_train_evaluate_and_export_a_model_that_generates(vision_project,
                                                                        tmp_path):
    import shutil

    from transformers import AutoModelForImageTextToText, AutoProcessor

    project = tmp_path / "p"
    shutil.copytree(vision_project, project, symlinks=True)
    write_params(project, {"registry.register_model": True})
    train_in_place(project)
    _open_training_run(project)  # the MLflow run the train stage opens: the registry logs there
    losses = logged_column(project, "loss")
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses  # steps 1, 2, 4, 6, 8
    stages_here(project, "evaluate", "export")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    assert metrics["finetuned"]["loss"] < metrics["base"]["loss"], metrics
    # greedy generations from each held-out image and question (a prompt's image tokens
    # without its pixel values would stop the model), base and tuned
    assert all(0 <= metrics[m]["exact_match"] <= 1 for m in ("base", "finetuned")), metrics
    samples = json.loads((project / "data/eval/samples.json").read_text())
    assert samples and all(s["reference"] in "1234" and "<image>" in s["prompt"]
                           for s in samples), samples
    export = project / "data/export"
    # registered in MLflow with its image processor beside the tokenizer
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version.get("registered") is not False, version
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    source = client.get_model_version(version["name"], version["version"]).source
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    flavor = mlflow.models.get_model_info(source).flavors["transformers"]
    assert flavor["task"] == "image-text-to-text"
    assert {"image_processor", "tokenizer"} <= set(flavor["components"]), flavor
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    processor = AutoProcessor.from_pretrained(export)
    from PIL import Image

    image = Image.open(project / "data/source/shapes/images/064.png").convert("RGB")
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                         "text": "How many squares?"}]}],
        add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt",
                       add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_full_fine_tuning_leaves_the_frozen_tower_and_projector_as_they_were(vision_project,
                                                                           tmp_path):
    """model.freeze_vision_tower and freeze_projector (both true by default, LLaMA-Factory's
    defaults): full fine-tuning moves the language model's weights and neither frozen part's;
    with freeze_projector false the projector moves too."""
    import shutil

    from engine.kinds.image_text_to_text import part_of

    base = _weights(vision_project / "data/models/tiny-llava")
    for freeze_projector, moved in ((True, {"language"}), (False, {"language", "projector"})):
        project = tmp_path / f"p{freeze_projector}"
        shutil.copytree(vision_project, project, symlinks=True)
        write_params(project, {"training.max_steps": 2, "model.freeze_projector":
                               freeze_projector, "eval.eval_strategy": "no",
                               "checkpoint.save_strategy": "no"})
        train_in_place(project)
        trained = _weights(project / "data/trained")
        assert trained.keys() == base.keys()
        changed = {part_of(k) for k, v in trained.items() if not torch.equal(v, base[k])}
        assert changed == moved, (freeze_projector, changed)


def test_lora_all_linear_adapts_the_language_model_only(vision_project, tmp_path):
    """peft.target_modules all-linear on a vision-language model: the language model's
    linear layers, one by one (not the vision tower's q/k/v, which share their leaf names),
    and the projector's too when it is not frozen."""
    import shutil

    from engine.kinds.image_text_to_text import part_of

    for freeze_projector, parts in ((True, {"language"}), (False, {"language", "projector"})):
        project = tmp_path / f"p{freeze_projector}"
        shutil.copytree(vision_project, project, symlinks=True)
        write_params(project, {"peft.use_peft": True, "training.max_steps": 2,
                               "model.freeze_projector": freeze_projector,
                               "eval.eval_strategy": "no", "checkpoint.save_strategy": "no"})
        train_in_place(project)
        adapted = json.loads((project / "data/trained/adapter_config.json").read_text())[
            "target_modules"]
        assert {part_of(m) for m in adapted} == parts, adapted
        assert any(m.endswith("self_attn.q_proj") for m in adapted)
        assert not any(part_of(m) == "vision" for m in adapted)


def test_a_vision_run_resumes_bitwise_from_what_a_crash_leaves(vision_project, tmp_path):
    """8 steps of LoRA with checkpoints at 4 and 8, cut back to what a crash right after step
    4 leaves and resumed: the same adapter, bit for bit, and the same losses (the images' rows
    in the same order, their pixel values the same batches)."""
    from helpers import resume_from_checkpoint_in_process

    resume_from_checkpoint_in_process(vision_project, tmp_path, {
        "peft.use_peft": True, "checkpoint.save_strategy": "steps", "checkpoint.save_steps": 4,
        "eval.eval_strategy": "no"}, 4)


@pytest.mark.distributed
def test_two_processes_equal_one(vision_project, tmp_path):
    """DDP on torchrun (gloo): 2 processes x 2 rows equal 1 process x 4 rows, the images
    split with their rows (SGD, so the weights compare without Adam's division)."""
    from helpers import assert_weights_close, losses, train_copy_here, train_here

    equal = {"training.max_steps": 4, "optimizer.name": "SGD", "optimizer.learning_rate": 0.5,
             "scheduler.warmup_steps": 0, "logging.logging_steps": 1,
             "eval.eval_strategy": "no", "checkpoint.save_strategy": "no"}
    one, _ = train_here(vision_project, tmp_path / "one", equal)
    two, _ = train_copy_here(vision_project, tmp_path / "two", {
        **equal, "distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
        "training.per_device_train_batch_size": 2})
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert_weights_close(_weights(two / "data/trained"), _weights(one / "data/trained"))


def test_dpo_with_images_trains_on_pairs_that_share_their_images(vision_project, tmp_path):
    """vision_preference (TRL's vision DPO layout) under training.type dpo, LoRA on the
    language model: both sides of a pair are encoded after the same prompt and image (image
    tokens untrained on both), the batch holds each pair's pixel values for both sides, and
    the run starts at log 2 and prefers the right count more after training."""
    import shutil

    import datasets

    project = tmp_path / "p"
    shutil.copytree(vision_project, project, symlinks=True)
    resolve_example(project, "params/vlm-shapes-dpo.yaml", {
        **VISION, "training.max_steps": 8, "logging.logging_steps": 1,
        "eval.eval_strategy": "no", "checkpoint.save_strategy": "no"})
    stages_here(project, "download", "format", "tokenize")
    ds = datasets.load_from_disk(str(project / "data/tokenized/train"))
    row = ds[0]
    image = 512  # the tiny LLaVA's <image>
    for ids, labels in ((row["input_ids"], row["labels"]),
                        (row["rejected_input_ids"], row["rejected_labels"])):
        at = [k for k, t in enumerate(ids) if t == image]
        assert len(at) == IMAGE_TOKENS and all(labels[k] == -100 for k in at)
    assert row["input_ids"][:at[0] + IMAGE_TOKENS] == row["rejected_input_ids"][:at[0] +
                                                                               IMAGE_TOKENS]
    assert row["pixel_shape"] == [1, 3, 32, 32]

    from engine.datapath.data import collate
    from engine.kinds.image_text_to_text import collate_with_images
    from engine.recipe.dpo.batches import collate_pairs

    batch = collate_pairs([ds[0], ds[1]], lambda r: collate_with_images(
        r, lambda x: collate(x, pad_id=0)))
    assert batch["pixel_values"].shape == (4, 3, 32, 32)  # chosen 0, 1, then rejected 0, 1
    assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][2])

    train_in_place(project)
    losses = logged_column(project, "loss")
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: the policy is its reference
    margins = logged_column(project, "rewards/margins")
    assert margins[-1] > margins[0] and losses[-1] < losses[0], (losses, margins)

    # the evaluate stage scores the held-out pairs with their images: the same log-probs as
    # a forward of the model on the pairs' batch with its pixel values
    from engine.recipe.dpo.heldout import pair_log_probs
    from transformers import AutoModelForImageTextToText

    test = datasets.load_from_disk(str(project / "data/tokenized/test"))
    base = AutoModelForImageTextToText.from_pretrained(project / "data/models/tiny-llava")
    sides = lambda r: collate_with_images(r, lambda x: collate(x, pad_id=0))  # noqa: E731
    with_images = pair_log_probs(base, test, 4, 0, sides)
    without = pair_log_probs(base, test, 4, 0)
    assert not torch.allclose(with_images, without)
    batch = collate_pairs([test[i] for i in range(4)], sides)
    with torch.no_grad():
        from engine.objective.logprobs import sequence_logps

        logits = base(**{k: batch[k] for k in ("input_ids", "attention_mask",
                                                "pixel_values")}).logits
        logps = sequence_logps(logits, batch["labels"])[0]
    torch.testing.assert_close(with_images[:4, 0], logps[:4].double(), atol=1e-4, rtol=0)
    stages_here(project, "evaluate")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    assert metrics["base"]["preference_accuracy"] == 0.5  # its own reference: every pair ties
    assert metrics["finetuned"]["reward_margin"] != 0


def test_an_image_edited_in_place_changes_the_formatted_split(vision_project, tmp_path):
    """The formatted rows keep each image's SHA-256 beside its path, so an image whose bytes
    change under the same name changes the formatted split DVC hashes, and the tokenize stage
    (whose pixel values came from the old bytes) runs again instead of being skipped."""
    import shutil

    import pandas as pd
    from PIL import Image

    project = tmp_path / "p"
    shutil.copytree(vision_project, project, symlinks=True)
    before = pd.read_parquet(project / "data/formatted/train.parquet")
    first = json.loads(before["images"].iloc[0])[0]
    Image.new("RGB", (32, 32), (9, 9, 9)).save(project / first)
    stages_here(project, "download", "format")
    after = pd.read_parquet(project / "data/formatted/train.parquet")
    assert after["images"].tolist() == before["images"].tolist()
    assert after["image_sha256"].iloc[0] != before["image_sha256"].iloc[0]
    assert after["image_sha256"].iloc[1:].tolist() == before["image_sha256"].iloc[1:].tolist()


def test_show_rows_counts_each_images_tokens_and_marks_the_answer(vision_project):
    """`finetune show-rows`: each image's 16 tokens shown once with their count, outside the
    trained marks; the answer and its end of turn inside them."""
    from finetune.workspace import Workspace
    from tasks.show_rows import show_rows

    text = show_rows(Workspace.load(vision_project / "params/default.yaml"), rows=1)
    assert f"<image>x{IMAGE_TOKENS} How many squares?" in text, text
    assert "<image><image>" not in text and "⟦" in text
    trained = text.split("⟦", 1)[1].split("⟧", 1)[0]
    assert "<image>" not in trained and "</s>" in trained, text
