"""`completion` (QEfficient: `seq_completion`): a prompt and a completion rendered from each row's
columns by `{column}` templates or `module:function` callables; the loss is on the completion
(and its EOS) only.

With no template and no function it is the `text` type: every token of one text column is
trained (the text field is auto-detected when omitted).
"""

from __future__ import annotations

from finetune.datatypes.base import DataContext, Formatted
from finetune.datatypes.rows import (TEMPLATE_KEYS, builder, check_exclusive_templates, render,
                                     template_columns)
from finetune.datatypes.text import TextType


class CompletionType(TextType):
    name = "completion"
    aliases = ("seq_completion",)
    keys = TEMPLATE_KEYS + ("input_columns", "text_field")

    @property
    def plain_text(self) -> bool:
        """No template and no function: the text type's rows."""
        return not any(getattr(self.data, k) for k in TEMPLATE_KEYS)

    def check(self) -> None:
        d = self.data
        check_exclusive_templates(d)
        has_prompt = d.prompt_template is not None or d.prompt_func
        has_completion = d.completion_template is not None or d.completion_func
        if has_prompt and not has_completion:
            raise ValueError("a prompt is set but no completion_template/completion_func")
        if has_completion and not has_prompt:
            raise ValueError("a completion is set but no prompt_template/prompt_func")
        if d.text_field and not self.plain_text:
            raise ValueError("text_field names the column trained on when no template is set; "
                             "with templates it would be unused: remove it or the templates")

    def prepare(self, ctx: DataContext) -> None:
        for part in ("prompt", "completion"):
            builder(self.data, part)  # a function by reference: imported and checked here

    def required_columns(self) -> list[str]:
        d = self.data
        if self.plain_text:
            return super().required_columns()
        return list(dict.fromkeys(template_columns(d)))

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        import pandas as pd

        if self.plain_text:
            return super().format(frame, split, ctx, first_row)
        texts = render(frame, {"prompt": builder(self.data, "prompt"),
                               "completion": builder(self.data, "completion")},
                       split, first_row)
        return Formatted.without_empty(pd.DataFrame(texts), first_row, "empty completion")

    def formatted_schema(self):
        from finetune.datatypes.contract import pair_schema

        return pair_schema(empty_prompt=self.plain_text)
