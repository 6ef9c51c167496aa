"""`text`: language modelling on one text column (`text_field`, auto-detected when omitted:
a column named text or content, else the only string column); every token is trained."""

from __future__ import annotations

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.encoding import encode_pairs
from finetune.datatypes.rows import detect_text_field, text_column


class TextType(DatasetType):
    name = "text"
    keys = ("text_field",)

    def required_columns(self) -> list[str]:
        return [self.data.text_field] if self.data.text_field else []

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        import pandas as pd

        column = detect_text_field(frame, self.data.text_field, split)
        rows = pd.DataFrame({"prompt": [""] * len(frame), "completion": text_column(frame, column)})
        return Formatted.without_empty(rows, first_row, f"empty '{column}'")

    def formatted_schema(self):
        from finetune.datatypes.contract import pair_schema

        return pair_schema(empty_prompt=True)

    def encoder(self, ctx: DataContext):
        return encode_pairs, {"bos": ctx.bos, "max_len": self.data.max_seq_length}
