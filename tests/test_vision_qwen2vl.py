"""The second family of issue 69: a Qwen2-VL built here from config (random weights; the
byte-level BPE tokenizer of tests/conftest.py with Qwen's vision tokens; a ChatML template),
trained on the shipped rows of drawn squares through the same dataset type and model kind as
the LLaVA of tests/test_vision.py. What differs from LLaVA and is checked here: the pixel values
are flattened patches ([patches, 3 * 2 * 4 * 4]) with an `image_grid_thw` row per image, and the
model places its 3-D positions from `mm_token_type_ids`, which the tokenized rows carry and the
batches pad; the processor is Qwen's. Without torchvision (not installed here) transformers
cannot build Qwen2VLProcessor (its video processor needs it), so the test registers an
image-only subclass with AutoProcessor in this process, where every stage runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import chat_bpe_tokenizer
from helpers import TINY, copy_project, logged_column, resolve_example, stages_here, train_in_place

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: 32x32 images, patch 4, merge 2: a grid of 1 x 8 x 8 patches, 16 image tokens
IMAGE_TOKENS = 16


def image_only_processor():
    """Qwen2VLProcessor without its video processor, registered for Qwen2-VL configs."""
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    AutoProcessor.register(Qwen2VLConfig, Qwen2VLImageOnlyProcessor, exist_ok=True)
    return Qwen2VLImageOnlyProcessor


def tiny_qwen2vl(dest: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    tok = chat_bpe_tokenizer()
    tok.add_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
                   special_tokens=True)
    tok.eos_token = "<|im_end|>"  # the template's end of turn (the model's eos below)
    tid = tok.convert_tokens_to_ids
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=tok.bos_token_id, eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"))
    Qwen2VLForConditionalGeneration(config).save_pretrained(dest)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=32 * 32,
                                               patch_size=4, temporal_patch_size=2,
                                               merge_size=2)
    image_only_processor()(image_processor=image_processor, tokenizer=tok,
                           chat_template=TEMPLATE).save_pretrained(dest)


QWEN = {**TINY, "model.name_or_path": "data/models/tiny-qwen2vl",
        "data.max_train_samples": 32, "data.max_eval_samples": 8, "training.max_steps": 8,
        "checkpoint.save_steps": 4, "eval.eval_steps": 4, "registry.register_model": False}


@pytest.fixture(scope="module")
def qwen_project(tmp_path_factory) -> Path:
    image_only_processor()
    project = copy_project(tmp_path_factory.mktemp("qwen2vl") / "p")
    tiny_qwen2vl(project / "data/models/tiny-qwen2vl")
    resolve_example(project, "params/vlm-shapes.yaml", QWEN)
    stages_here(project, "download", "format", "tokenize")
    return project


def test_qwen2vl_rows_carry_patches_grids_and_token_types(qwen_project):
    import datasets
    from transformers import AutoProcessor

    ds = datasets.load_from_disk(str(qwen_project / "data/tokenized/train"))
    processor = AutoProcessor.from_pretrained(qwen_project / "data/models/tiny-qwen2vl")
    image = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    row = ds[0]
    at = [k for k, t in enumerate(row["input_ids"]) if t == image]
    assert len(at) == IMAGE_TOKENS and all(row["labels"][k] == -100 for k in at)
    assert row["pixel_shape"] == [64, 96] and row["image_grid_thw"] == [[1, 8, 8]]
    assert [k for k, t in enumerate(row["mm_token_type_ids"]) if t == 1] == at
    trained = processor.tokenizer.decode([t for t, lab in zip(row["input_ids"], row["labels"])
                                          if lab != -100])
    assert trained.strip().startswith(tuple("1234")) and "<|im_end|>" in trained, trained

    from engine.datapath.data import collate
    from engine.kinds.image_text_to_text import collate_with_images

    batch = collate_with_images([ds[i] for i in range(3)], lambda r: collate(r, pad_id=0))
    assert batch["pixel_values"].shape == (3 * 64, 96)
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]] * 3
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert int(batch["mm_token_type_ids"].sum()) == 3 * IMAGE_TOKENS


def test_qwen2vl_trains_evaluates_and_exports(qwen_project, tmp_path):
    import shutil

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    project = tmp_path / "p"
    shutil.copytree(qwen_project, project, symlinks=True)
    train_in_place(project)
    losses = logged_column(project, "loss")
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses
    stages_here(project, "evaluate", "export")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    assert metrics["finetuned"]["loss"] < metrics["base"]["loss"], metrics
    export = project / "data/export"
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    processor = AutoProcessor.from_pretrained(export)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                         "text": "How many squares?"}]}],
        add_generation_prompt=True)
    image = Image.open(project / "data/source/shapes/images/064.png").convert("RGB")
    inputs = processor(text=[prompt], images=[image], return_tensors="pt",
                       add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
