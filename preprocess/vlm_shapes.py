"""The vision example (params/vlm-shapes.yaml): a tiny LLaVA and rows of drawn squares, made
here so nothing with a licence is shipped:

    python -m preprocess.vlm_shapes      # writes data/models/tiny-llava, data/source/shapes/

- `data/models/tiny-llava/`: a 2-layer LLaVA (Llama text model, 1-layer CLIP vision tower,
  random weights from seed 0) whose vocabulary is stories260K's plus `<image>`, with its
  processor (a CLIP image processor, 32x32, patch 8: 16 tokens per image) and a chat template
  that writes `<image>` for each image part;
- `data/source/shapes/`: `train.jsonl` (64 rows) and `test.jsonl` (16) in TRL's layout, each
  an image of 1-4 white squares on black (`images/NNN.png`), the question and the count;
  `pairs-train.jsonl` and `pairs-test.jsonl`, the same rows as TRL's vision DPO layout
  (`prompt` turn with the image, `chosen` the count, `rejected` a wrong one, `images`), for
  params/vlm-shapes-dpo.yaml.

What it shows is the data path, not a capable model: a model of this size learns the answer's
form and the distribution of counts. No randomness beyond the fixed seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

#: LLaVA's convention: `<image>` for each image part; a content is a string or a list of parts
#: in every role (TRL's layout writes parts); newlines as {{ '\n' }}, since jinja's
#: trim_blocks (which transformers renders with) drops a literal one after a tag
TEMPLATE = ("{% for m in messages %}"
            "{% if m['role'] == 'user' %}User: {% elif m['role'] == 'assistant' %}Assistant: "
            "{% endif %}"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
            "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
#: TEMPLATE with TRL's `{% generation %}` markers around what our chat type trains of an
#: assistant turn (the space after "Assistant:", the answer, EOS, the newline) and BOS first, as
#: our encoding adds the tokenizer's: what TRL's vision collators render with to train the same
#: tokens (tests/test_vision_trl.py, bench/vlm_sft_vs_trl.py)
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}User: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% elif m['role'] == 'assistant' %}Assistant:{% generation %} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{{ eos_token }}"
    "{{ '\\n' }}{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")
#: image tokens per 32x32 image: (32 / 8) ** 2 patches, CLS dropped ("default" strategy)
IMAGE_TOKENS = 16


def tiny_llava(dest: Path, tokenizer: Path) -> int:
    """A 2-layer LLaVA (Llama text model, 1-layer CLIP tower) and its processor in `dest`;
    returns the `<image>` token's id."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig,
                              LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor)

    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TEMPLATE
    image = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id),
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       image_size=32, patch_size=8, projection_dim=16),
        image_token_index=image, vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    LlavaForConditionalGeneration(config).save_pretrained(dest)
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                      crop_size={"height": 32, "width": 32}),
                   tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=TEMPLATE).save_pretrained(dest)
    return image


def shapes_rows(folder: Path, count: int, first: int = 0) -> list[dict]:
    """`count` rows: an image of 1-4 white squares on black, the question, the count. Each
    square fills one 8x8 patch of the vision tower (a row of them, the row varying), so the
    count is how many patches are white: a tiny model can learn it."""
    from PIL import Image, ImageDraw

    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(first, first + count):
        n = 1 + i % 4
        image = Image.new("RGB", (32, 32))
        draw = ImageDraw.Draw(image)
        for k in range(n):
            x, y = 8 * k, 8 * (i // 4 % 4)
            draw.rectangle([x, y, x + 7, y + 7], fill=(255, 255, 255))
        name = f"images/{i:03d}.png"
        image.save(folder / name)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "How many squares?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"{n}"}]}],
            "images": [name]})  # every content a list of parts: TRL's layout
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))




def pairs_of(rows: list[dict]) -> list[dict]:
    """Preference rows from counting rows: the right count chosen, the next one (mod 4)
    rejected, the prompt turn and its image shared."""
    pairs = []
    for r in rows:
        right = r["messages"][1]["content"][0]["text"]
        wrong = str(int(right) % 4 + 1)
        pairs.append({"prompt": r["messages"][:1],
                      "chosen": [{"role": "assistant", "content": [{"type": "text",
                                                                     "text": right}]}],
                      "rejected": [{"role": "assistant", "content": [{"type": "text",
                                                                       "text": wrong}]}],
                      "images": r["images"]})
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--test", type=int, default=16)
    args = parser.parse_args(argv)
    tiny_llava(ROOT / "data/models/tiny-llava", ROOT / "data/models/stories260K")
    source = ROOT / "data/source/shapes"
    train, test = shapes_rows(source, args.train), shapes_rows(source, args.test, first=args.train)
    write_rows(source / "train.jsonl", train)
    write_rows(source / "test.jsonl", test)
    write_rows(source / "pairs-train.jsonl", pairs_of(train))
    write_rows(source / "pairs-test.jsonl", pairs_of(test))


if __name__ == "__main__":
    main()
