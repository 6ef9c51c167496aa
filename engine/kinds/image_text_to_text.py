"""A vision-language model (transformers' AutoModelForImageTextToText: LLaVA, Qwen2-VL and
Qwen2.5-VL, Idefics3/SmolVLM, Gemma 3): a causal LM whose inputs hold images. Its text is a
causal LM's (the processor already put each image's tokens into input_ids, so logits and labels
line up as a decoder's do, and the loss is the next-token one); what it adds are the images'
inputs, which ride in the tokenized rows (finetune.datatypes.vision) and are stacked here into
the model's `pixel_values` (and `image_grid_thw` where the model takes one), and its processor,
which the data stages encode with and the trained folder keeps beside the weights.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.datapath.data import collate
from engine.kinds.base import ModelKind
from engine.modeling.model import base_model, resolve_model_ref
from engine.objective.loss import build_loss
from finetune.errors import PipelineError

#: the forward's image inputs a batch may carry
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
#: the tokenized columns they are made from (finetune.datatypes.vision.IMAGE_COLUMNS; a
#: preference pair's rejected side has its own token types)
IMAGE_COLUMNS = ("pixel_values", "pixel_shape", "image_grid_thw", "mm_token_type_ids",
                 "rejected_mm_token_type_ids")


def image_inputs(rows: list[dict]) -> dict[str, torch.Tensor]:
    """The batch's images: each row's pixel values reshaped and concatenated along the first
    axis in row order (the order the model meets their placeholder tokens in), and the grid
    sizes likewise; nothing when no row has an image."""
    arrays = [np.asarray(r["pixel_values"], dtype=np.float32).reshape(r["pixel_shape"])
              for r in rows if r.get("pixel_shape") and r["pixel_shape"][0]]
    if not arrays:
        return {}
    out = {"pixel_values": torch.from_numpy(np.concatenate(arrays))}
    grids = [g for r in rows for g in (r.get("image_grid_thw") or [])]
    if grids:
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
    return out


def collate_with_images(rows: list[dict], text_collate) -> dict[str, torch.Tensor]:
    """The text batch and its images; a model that reads token types (Qwen2-VL's
    mm_token_type_ids: 1 on an image token) gets them padded as its ids are, with 0."""
    batch = {**text_collate(rows), **image_inputs(rows)}
    if any(r.get("mm_token_type_ids") for r in rows):
        types = torch.zeros_like(batch["input_ids"])
        for i, r in enumerate(rows):
            row = r["mm_token_type_ids"]
            types[i, :len(row)] = torch.as_tensor(row, dtype=types.dtype)
        batch["mm_token_type_ids"] = types
    return batch


def text_token_ids(config) -> int:
    """How many ids from 0 are text tokens: the text model's vocabulary, up to the first of
    the placeholder ids the model replaces with image or video features."""
    vocab = config.get_text_config().vocab_size
    placeholders = [getattr(config, name, None) for name in (
        "image_token_id", "image_token_index", "video_token_id", "vision_start_token_id")]
    return min([vocab, *(p for p in placeholders if isinstance(p, int) and p > 0)])


#: module-name parts of the vision tower and of the projector across the families
#: (LLaVA's vision_tower and multi_modal_projector, Qwen2-VL's visual and its merger,
#: Idefics3's vision_model and connector); a projector inside the tower is the projector
VISION_PARTS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder")
PROJECTOR_PARTS = ("multi_modal_projector", "merger", "connector", "mm_projector", "aligner")


def part_of(name: str) -> str:
    """'projector', 'vision' or 'language' for a module or parameter name."""
    parts = name.split(".")
    if any(p in PROJECTOR_PARTS for p in parts):
        return "projector"
    if any(p in VISION_PARTS for p in parts):
        return "vision"
    return "language"


def frozen_parts(model_cfg) -> set[str]:
    return ({"vision"} if model_cfg.freeze_vision_tower else set()) | (
        {"projector"} if model_cfg.freeze_projector else set())


class ImageTextToText(ModelKind):
    name = "image_text_to_text"
    extra_model_inputs = IMAGE_INPUTS
    data_columns = IMAGE_COLUMNS

    def check_architecture(self, model_config, source: str) -> None:
        if getattr(model_config, "vision_config", None) is None:
            kind = getattr(model_config, "model_type", None) or type(model_config).__name__
            raise PipelineError(f"{source}: a {kind} model has no vision tower "
                                "(config.vision_config); data.dataset_type vision_chat trains "
                                "a vision-language model (AutoModelForImageTextToText)")

    def prepare_base(self, model, cfg):
        """Full fine-tuning: the frozen parts (model.freeze_vision_tower, freeze_projector)
        stop training. LoRA with target_modules all-linear: the language model's linear layers
        (and those of a part not frozen), named one by one; target_modules naming modules
        itself is the user's choice, vision modules included."""
        frozen = frozen_parts(cfg.model)
        if not cfg.peft.use_peft:
            for name, param in model.named_parameters():
                if part_of(name) in frozen:
                    param.requires_grad_(False)
            return cfg.peft
        if cfg.peft.target_modules != "all-linear":
            return cfg.peft
        output = model.get_output_embeddings()
        names = sorted(name for name, module in model.named_modules()
                       if isinstance(module, torch.nn.Linear) and module is not output
                       and part_of(name) not in frozen)
        return cfg.peft.model_copy(update={"target_modules": names})

    def processor(self, tokenizer, model_cfg, root):
        """The model folder's AutoProcessor around the run's tokenizer (its added tokens)."""
        from transformers import AutoProcessor

        ref = resolve_model_ref(model_cfg.name_or_path, root)
        try:
            processor = AutoProcessor.from_pretrained(ref, revision=model_cfg.revision,
                                                      trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            hint = (" (transformers' video processors need torchvision: pip install "
                    "torchvision)" if "video processor" in first.lower() else "")
            raise PipelineError(f"model.name_or_path {model_cfg.name_or_path}: no processor "
                                f"for its images ({first}){hint}; a vision-language model's "
                                "folder holds its processor_config.json") from None
        if getattr(processor, "image_processor", None) is None:
            raise PipelineError(f"model.name_or_path {model_cfg.name_or_path}: AutoProcessor "
                                f"found a {type(processor).__name__} and no image processor "
                                "(the folder names no processor, or a processor class this "
                                "process has not imported); save the model's processor there")
        processor.tokenizer = tokenizer
        return processor

    def loss(self, model, cfg, device, amp, user_fn=None):
        """The causal LM's loss, its chunked form probed on text tokens alone (below every
        image and video token id: a placeholder without pixels is refused by the model)."""
        return build_loss(model, cfg.training.loss_chunk_tokens, device, amp,
                          vocab_size=text_token_ids(base_model(model).config), user_fn=user_fn)

    def prompt_inputs(self, processor, rows, room, root):
        """Each prompt through the processor with its row's images (the eval rows' `images`,
        finetune.datatypes.vision), BOS first where the tokenizer adds one; the batch's
        pixel values, grids and token types (left-padded as the ids are) come with it. A
        prompt longer than `room` cannot lose its head without losing image tokens: one
        line."""
        import json

        from finetune.datatypes.encoding import bos_prefix_id
        from finetune.datatypes.vision import IMAGES, load_images

        tok = processor.tokenizer
        bos = bos_prefix_id(tok)
        ids, extra = [], []
        for i, (prompt, paths) in enumerate(zip(rows["prompt"], rows[IMAGES])):
            images = load_images(json.loads(paths), root)
            inputs = processor(text=[prompt], images=images or None, add_special_tokens=False,
                               return_tensors="pt")
            head = [bos] if bos is not None else []
            row = head + inputs["input_ids"][0].tolist()
            if room and len(row) > room:
                raise PipelineError(f"evaluate: generation prompt {i} has {len(row)} tokens with "
                                    f"its images, more than the {room} the model's positions "
                                    "leave beside eval.generation_max_new_tokens; lower it")
            ids.append(row)
            types = inputs.get("mm_token_type_ids")
            extra.append({"pixel_values": inputs.get("pixel_values"),
                          "image_grid_thw": inputs.get("image_grid_thw"),
                          "mm_token_type_ids": None if types is None else
                          [0] * len(head) + types[0].tolist()})

        def extras(indices, width: int) -> dict[str, torch.Tensor]:
            chosen = [extra[i] for i in indices]
            out = {}
            pixels = [e["pixel_values"] for e in chosen if e["pixel_values"] is not None]
            if pixels:
                out["pixel_values"] = torch.cat(pixels)
            grids = [e["image_grid_thw"] for e in chosen if e["image_grid_thw"] is not None]
            if grids:
                out["image_grid_thw"] = torch.cat(grids)
            if any(e["mm_token_type_ids"] is not None for e in chosen):
                types = torch.zeros((len(chosen), width), dtype=torch.long)
                for row, e in enumerate(chosen):
                    kinds = e["mm_token_type_ids"] or []
                    if kinds:
                        types[row, width - len(kinds):] = torch.tensor(kinds)
                out["mm_token_type_ids"] = types
            return out

        return ids, extras

    def train_collate(self, cfg, model, pad_id, layout):
        return functools.partial(collate_with_images, text_collate=layout)

    def eval_collate(self, cfg, model, pad_id):
        return functools.partial(collate_with_images, text_collate=functools.partial(
            collate, pad_id=pad_id))
