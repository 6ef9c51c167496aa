"""`vision_chat`: conversations whose user turns hold images, in TRL's layout, for a
vision-language model (transformers' AutoModelForImageTextToText, the `image_text_to_text`
model kind: engine.kinds.image_text_to_text).

A row is the `chat` type's `messages` whose user contents may list parts
(`[{"type": "image"}, {"type": "text", "text": "How many circles?"}]`) and an `images` column:
one image per image part, in order, each a path relative to the folder of the source's data
files (or an absolute one). The format step checks that every image is there and opens as one
(a missing or unreadable file is one line naming the row and the file, before anything is
written) and keeps the paths, relative to the project, beside the conversation. Tokenization
renders the conversation with the chat template (its image parts become the template's image
placeholder), masks it as the chat type does (assistant turns trained), then runs the model's
processor on the text and the images: the processor expands each placeholder into the image's
tokens exactly as the model expects, and those tokens are never trained. The pixel values
(flattened, with their shape) and, where the model takes them, the image grid sizes are
columns of the tokenized row, so a training batch stacks arrays instead of decoding images.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from finetune.datatypes.base import IMAGE_TEXT_TO_TEXT, DataContext, Formatted
from finetune.datatypes.chat import ChatType, chat_template
from finetune.datatypes.conversation import image_count, parse
from finetune.datatypes.encoding import IGNORE_INDEX, add_row, empty_encoding
from finetune.datatypes.preference import REJECTED_COLUMNS, PreferenceType, add_pair
from finetune.datatypes.turns import MaskRules, end_of_turn, sequences, token_mask
from finetune.errors import PipelineError

#: the row column of each row's images (TRL's name)
IMAGES = "images"
#: the formatted column of their contents' SHA-256, in the images' order
IMAGE_DIGESTS = "image_sha256"
#: the tokenized columns of a row's images: pixel values flattened, their array shape, and what
#: the models that take them get besides (Qwen2-VL's image_grid_thw, and mm_token_type_ids: 1
#: on an image token, from which it places its 3-D positions; empty otherwise)
IMAGE_COLUMNS = ("pixel_values", "pixel_shape", "image_grid_thw", "mm_token_type_ids")


class VisionChatType(ChatType):
    name = "vision_chat"
    aliases = ("vision",)
    task = IMAGE_TEXT_TO_TEXT
    takes_images = True

    def required_columns(self) -> list[str]:
        return [*super().required_columns(), IMAGES]

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """The chat type's rows, each with its images (JSON: paths relative to the project),
        checked against its image parts: as many images as parts, each a readable image."""
        if IMAGES not in frame.columns:
            raise PipelineError(f"split '{split}' has no '{IMAGES}' column; data.dataset_type "
                                f"{self.name} reads each row's images there (a list of paths)")
        field = messages_column(frame, self.data)
        images = checked_images(self.data, frame, split, ctx, first_row, [field])
        return with_images(super().format(frame, split, ctx, first_row), images, first_row,
                           len(frame), ctx.root)

    def eval_rows(self, formatted):
        """One row per held-out conversation: the prompt up to its last assistant turn, that
        turn's text as the reference, and the row's images (the generation reads them)."""
        import pandas as pd

        return pd.DataFrame({"prompt": formatted["prompt"], "reference": formatted["completion"],
                             IMAGES: formatted[IMAGES]})

    def encoder(self, ctx: DataContext):
        fn, kwargs = super().encoder(ctx)
        return encode_vision_chat_batch, {**kwargs, "processor": ctx.processor,
                                          "root": str(ctx.root)}


def checked_images(data, frame, split: str, ctx: DataContext, first_row: int,
                   message_columns: list[str]) -> dict[int, list[str]]:
    """Row number -> its images (paths relative to the project), each opened, as many as the
    image parts of the row's first message list among `message_columns` (a pair's `prompt`,
    else its `chosen`, which holds the shared prompt turns); one line naming the row and the
    file."""
    if IMAGES not in frame.columns:
        raise PipelineError(f"split '{split}' has no '{IMAGES}' column; data.dataset_type "
                            f"{data.dataset_type} reads each row's images there (a list of "
                            "paths)")
    folder = source_folder(data, ctx.root)
    images = {}
    columns = [c for c in message_columns if c in frame.columns]
    for k, value in enumerate(frame[IMAGES].tolist()):
        i = first_row + k
        where = f"split '{split}' row {i} column '{IMAGES}'"
        paths = image_paths(value, where, folder, ctx.root)
        holder = next((c for c in columns if frame[c].iloc[k] is not None
                       and not isinstance(frame[c].iloc[k], (str, float))), None)
        wanted = 0 if holder is None else image_count(
            parse(frame[holder].iloc[k], f"split '{split}' row {i} column '{holder}'"))
        if len(paths) != wanted:
            raise PipelineError(f"{where}: {len(paths)} images for {wanted} image parts in "
                                "the messages; give one image per {\"type\": \"image\"}")
        images[i] = paths
    return images


def with_images(out: Formatted, images: dict[int, list[str]], first_row: int,
                rows: int, root: Path) -> Formatted:
    """The formatted rows with each kept row's images (JSON) beside them, and their contents'
    SHA-256 (IMAGE_DIGESTS): the formatted split, which DVC hashes and the tokenize stage
    depends on, changes when an image's bytes do, not only its path."""
    from finetune.files import file_sha256

    dropped = set(out.dropped)
    kept = [i for i in range(first_row, first_row + rows) if i not in dropped]
    frame = out.rows.copy()
    frame[IMAGES] = [json.dumps(images[i]) for i in kept]
    frame[IMAGE_DIGESTS] = [json.dumps([file_sha256(resolved(p, root)) for p in images[i]])
                            for i in kept]
    return Formatted(frame, out.dropped, out.reason, out.reasons)


def resolved(path: str, root: Path) -> Path:
    """An image path as the formatted rows keep it (relative to the project, or absolute)."""
    return Path(path) if Path(path).is_absolute() else Path(root) / path


class VisionPreferenceType(PreferenceType):
    """`vision_preference`: TRL's vision DPO layout, the preference type's conversational pairs
    (`prompt` turns holding the image parts, `chosen`, `rejected`) with an `images` column.
    Each side is encoded as the preference type encodes it (prompt and side apart, the side
    trained), the prompt by the model's processor with the images, so both sides share the
    row's pixel values; the rejected side's token types are its own column."""

    name = "vision_preference"
    aliases = ("vision_dpo",)
    task = IMAGE_TEXT_TO_TEXT

    def required_columns(self) -> list[str]:
        return [*super().required_columns(), IMAGES]

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        images = checked_images(self.data, frame, split, ctx, first_row,
                                ["prompt", "chosen"])
        return with_images(super().format(frame, split, ctx, first_row), images, first_row,
                           len(frame), ctx.root)

    def eval_rows(self, formatted):
        """The prompt with its images; the chosen side as the reference."""
        import pandas as pd

        return pd.DataFrame({"prompt": formatted["prompt"], "reference": formatted["completion"],
                             IMAGES: formatted[IMAGES]})

    def encoder(self, ctx: DataContext):
        return encode_vision_preference, {"bos": ctx.bos, "max_len": self.data.max_seq_length,
                                          "processor": ctx.processor, "root": str(ctx.root)}


def encode_vision_preference(batch: dict[str, list], tok, processor, root: str,
                             bos: int | None, max_len: int) -> dict[str, list]:
    """Both sides of each pair: [BOS] + the prompt as the processor encodes it with the row's
    images (image tokens expanded, untrained) + the side's tokens (trained; EOS where the row
    says), each cut to `max_len`; `n_trainable` the smaller side's (0 when the sides are left
    equal). The row's pixel values are stored once."""
    out = {**empty_encoding(), **{c: [] for c in (*REJECTED_COLUMNS, *IMAGE_COLUMNS,
                                                  "rejected_mm_token_type_ids")}}
    eos = tok.eos_token_id
    head_bos = [bos] if bos is not None else []
    for prompt, chosen, rejected, end, paths in zip(batch["prompt"], batch["completion"],
                                                    batch["rejected"], batch["eos"],
                                                    batch[IMAGES]):
        images = load_images(json.loads(paths), Path(root))
        inputs = processor(text=[prompt], images=images or None, add_special_tokens=False,
                           return_tensors="np")
        head = head_bos + inputs["input_ids"][0].tolist()
        types = inputs.get("mm_token_type_ids")
        head_types = [0] * len(head_bos) + ([] if types is None else types[0].tolist())
        tail = [eos] if end else []
        sides = []
        for text in (chosen, rejected):
            body = tok(text, add_special_tokens=False)["input_ids"] + tail
            ids, labels = head + body, [IGNORE_INDEX] * len(head) + body
            kinds = (head_types + [0] * len(body)) if types is not None else []
            sides.append((ids[:max_len], labels[:max_len], kinds[:max_len], len(ids) > max_len))
        (c_ids, c_labels, c_types, c_cut), (r_ids, r_labels, r_types, r_cut) = sides
        add_pair(out, (c_ids, c_labels, c_cut), (r_ids, r_labels, r_cut))
        out["mm_token_type_ids"].append(c_types)
        out["rejected_mm_token_type_ids"].append(r_types)
        add_pixels(out, inputs, bool(images))
    return out


def messages_column(frame, data) -> str:
    from finetune.datatypes.chat import messages_field

    return messages_field(frame, data, "the split")


def source_folder(data, root: Path) -> Path:
    """The folder relative image paths start from: the one holding the source's data files
    (its train file's), else the project root."""
    files = data.data_files if isinstance(data.data_files, dict) else {}
    first = data.json_file_path or next(iter(files.values()), None)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    if not first:
        return Path(root)
    path = Path(first)
    return (path if path.is_absolute() else Path(root) / path).parent


def image_paths(value, where: str, folder: Path, root: Path) -> list[str]:
    """A row's images as paths relative to `root` (posix), each checked to open as an image;
    `value` a list (or a JSON string of one) of paths or {"path": ...} mappings."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]
    if value is None:
        value = []
    if not isinstance(value, list):
        raise PipelineError(f"{where}: not a list of image paths")
    out = []
    for k, item in enumerate(value):
        path = item.get("path") if isinstance(item, dict) else item
        if not isinstance(path, str) or not path:
            raise PipelineError(f"{where} image {k}: not a path (a string, or {{\"path\": ...}})")
        file = Path(path) if Path(path).is_absolute() else folder / path
        if not file.is_file():
            raise PipelineError(f"{where} image {k}: {file} not found")
        try:
            with Image.open(file) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise PipelineError(f"{where} image {k}: {file} is not a readable image "
                                f"({type(exc).__name__})") from None
        try:
            out.append(file.resolve().relative_to(Path(root).resolve()).as_posix())
        except ValueError:
            out.append(str(file.resolve()))
    return out


def load_images(paths: list[str], root: Path) -> list:
    from PIL import Image

    images = []
    for path in paths:
        with Image.open(resolved(path, root)) as image:
            images.append(image.convert("RGB"))
    return images


def encode_vision_chat_batch(batch: dict[str, list], tok, processor, root: str, template: str,
                             bos: int | None, max_len: int,
                             roles: list[str] | None = ("assistant",), last_only: bool = False,
                             eos: bool = True, reasoning: bool = True) -> dict[str, list]:
    """The tokenize map function of vision_chat rows: the chat type's sequences and masks on
    the text, then the processor on the text and the row's images; each run of image tokens
    the processor put where the template wrote one placeholder is untrained, and the row's
    pixel values ride along. A row cut by max_seq_length inside or before its images would
    feed the model fewer image tokens than its pixels make: it keeps no trained token (and is
    dropped and counted as the rows with nothing to learn are)."""
    rules = MaskRules(tuple(roles) if roles is not None else None, last_only, eos, reasoning)
    marker = end_of_turn(tok, template) if not eos else None
    image_token = image_token_id(processor, tok)
    out = {**empty_encoding(), **{c: [] for c in IMAGE_COLUMNS}}
    for i, (text, paths) in enumerate(zip(batch["messages"], batch[IMAGES])):
        conv, images = json.loads(text), load_images(json.loads(paths), Path(root))
        for seq in sequences(tok, template, conv, None, rules, f"row {i}", marker):
            enc = tok(seq.text, add_special_tokens=False, return_offsets_mapping=True)
            ids = enc["input_ids"]
            trained = token_mask(enc["offset_mapping"], seq.char_mask()).tolist()
            used = sum(1 for t in ids if t == image_token)
            inputs = processor(text=[seq.text], images=images[:used] or None,
                               add_special_tokens=False, return_tensors="np")
            expanded = inputs["input_ids"][0].tolist()
            labels = expand_labels(ids, trained, expanded, image_token, f"row {i}")
            head = ([bos] if bos is not None and not seq.text.startswith(tok.bos_token or "\0")
                    else [])
            ids, labels = head + expanded, [IGNORE_INDEX] * len(head) + labels
            if len(ids) > max_len and image_token in ids[max_len - 1:]:
                labels = [IGNORE_INDEX] * len(labels)  # cut inside its images: dropped
            add_row(out, ids, labels, max_len)
            types = inputs.get("mm_token_type_ids")
            out["mm_token_type_ids"].append(
                [] if types is None else ([0] * len(head) + types[0].tolist())[:max_len])
            add_pixels(out, inputs, bool(used))
    return out


def add_pixels(out: dict[str, list], inputs, has_images: bool) -> None:
    """A row's image columns from the processor's output: its pixel values flattened with
    their shape, and the grid sizes where the model takes them (empty for a row without
    images)."""
    pixels = inputs.get("pixel_values")
    pixels = np.zeros((0,), np.float32) if pixels is None or not has_images else pixels
    out["pixel_values"].append(np.asarray(pixels, np.float32).ravel().tolist())
    out["pixel_shape"].append(list(np.shape(pixels)))
    grid = inputs.get("image_grid_thw")
    out["image_grid_thw"].append([] if grid is None or not has_images
                                 else np.asarray(grid).tolist())


def image_token_id(processor, tok) -> int:
    """The id of the placeholder token the processor expands (its `image_token_id`, else its
    `image_token`'s id)."""
    found = getattr(processor, "image_token_id", None)
    if found is None and getattr(processor, "image_token", None):
        found = tok.convert_tokens_to_ids(processor.image_token)
    if found is None:
        raise PipelineError(f"{type(processor).__name__}: no image token; data.dataset_type "
                            "vision_chat needs the model's processor (AutoProcessor) and a "
                            "vision-language model")
    return int(found)


def expand_labels(ids: list[int], trained: list[bool], expanded: list[int], image: int,
                  where: str) -> list[int]:
    """The labels of `expanded` (the processor's ids: `ids` with each image token repeated
    as many times as the image has tokens): a text token keeps its mask, every image token
    is untrained."""
    labels, j = [], 0
    for token, keep in zip(ids, trained):
        if token == image:
            start = j
            while j < len(expanded) and expanded[j] == image:
                j += 1
            if j == start:
                break
            labels.extend([IGNORE_INDEX] * (j - start))
            continue
        if j >= len(expanded) or expanded[j] != token:
            break
        labels.append(token if keep else IGNORE_INDEX)
        j += 1
    if j != len(expanded) or len(labels) != len(expanded):
        raise PipelineError(f"{where}: the processor's tokens are not the text's with each "
                            "image token repeated; data.dataset_type vision_chat reads "
                            "processors that expand an image that way (LLaVA, Qwen2-VL)")
    return labels
