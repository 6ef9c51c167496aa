"""The Ollama `Modelfile` written beside the GGUF files: `ollama create NAME -f Modelfile`.

It says which file to build from (`FROM ./<file>.gguf`), how a prompt is laid out (`TEMPLATE`,
Ollama's Go-template syntax), where generation stops (`PARAMETER stop`) and how it samples. The
prompt layout is the one the model was trained on, in this order:

1. a chat run (data.dataset_type chat, or data.chat_template set): the tokenizer's chat
   template, when it is one of the layouts below (ChatML, Llama 3, Gemma). A layout counts only
   when it renders a sample conversation exactly as the Jinja template does (so a template with
   a default system prompt or a date line is not taken for plain ChatML / Llama 3);
2. a prompt template with one column (data.prompt_template, e.g. the default
   `Question: {question}\\nAnswer:`): that text with the column as `{{ .Prompt }}`;
3. otherwise `{{ .Prompt }}` alone, with a comment saying why.

The text depends only on its arguments (the export is a DVC out: same run, same bytes).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass

#: the sample conversation a layout must render exactly as the chat template does
_SYSTEM = {"role": "system", "content": "You are terse."}
_TURNS = [{"role": "user", "content": "Hi there"},
          {"role": "assistant", "content": "Hello."},
          {"role": "user", "content": "What is 2+2?"}]


@dataclass(frozen=True)
class ChatLayout:
    """A chat format as the text around each role's content; `system` None: no system turn
    (Ollama's SYSTEM is then left out, as the Jinja template has no place for it)."""

    name: str
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation: str  #: what opens the model's turn
    stops: tuple[str, ...]  #: the tokens that end a turn
    system: tuple[str, str] | None = None

    def render(self, messages: list[dict]) -> str:
        """What the Go template below makes of `messages`, in Python: the check against the
        Jinja template."""
        roles = {"system": self.system, "user": self.user, "assistant": self.assistant}
        return "".join(roles[m["role"]][0] + m["content"] + roles[m["role"]][1]
                       for m in messages) + self.generation

    def go_template(self) -> str:
        branches = [("system", self.system), ("user", self.user),
                    ("assistant", self.assistant)]
        body = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
                       f"{_go_text(before)}{{{{ .Content }}}}{_go_text(after)}"
                       for i, (role, (before, after)) in enumerate(
                           (r, p) for r, p in branches if p is not None))
        return f"{{{{ range .Messages }}}}{body}{{{{ end }}}}{{{{ end }}}}" \
               f"{_go_text(self.generation)}"


CHAT_LAYOUTS = (
    ChatLayout("ChatML", user=("<|im_start|>user\n", "<|im_end|>\n"),
               assistant=("<|im_start|>assistant\n", "<|im_end|>\n"),
               generation="<|im_start|>assistant\n", stops=("<|im_end|>", "<|im_start|>"),
               system=("<|im_start|>system\n", "<|im_end|>\n")),
    ChatLayout("Llama 3",
               user=("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
               assistant=("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
               generation="<|start_header_id|>assistant<|end_header_id|>\n\n",
               stops=("<|eot_id|>", "<|start_header_id|>"),
               system=("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")),
    ChatLayout("Gemma", user=("<start_of_turn>user\n", "<end_of_turn>\n"),
               assistant=("<start_of_turn>model\n", "<end_of_turn>\n"),
               generation="<start_of_turn>model\n", stops=("<end_of_turn>",
                                                           "<start_of_turn>")),
)


def _go_text(text: str) -> str:
    """Literal text inside a Go template: `{{` would open an action, so it is written as
    one."""
    return text.replace("{{", '{{ "{{" }}')


def chat_layout(tokenizer, template: str) -> ChatLayout | None:
    """The layout `template` (Jinja) renders the sample conversation as, None when none does
    (the tokenizer's BOS, which llama.cpp adds itself, is not compared)."""
    bos = getattr(tokenizer, "bos_token", None) or ""

    def renders_as(layout: ChatLayout, messages: list[dict]) -> bool:
        try:
            rendered = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses the sample (Gemma's, a system turn)
            return False
        if bos and rendered.startswith(bos):
            rendered = rendered[len(bos):]
        return rendered == layout.render(messages)

    for layout in CHAT_LAYOUTS:
        # with and without a system turn: a default system prompt would show in the second
        samples = [[_SYSTEM, *_TURNS], _TURNS] if layout.system else [_TURNS]
        if all(renders_as(layout, messages) for messages in samples):
            return layout
    return None


def prompt_layout(prompt_template: str | None) -> str | None:
    """`prompt_template` as a Go template when it names exactly one column (that column is
    what the user types, `{{ .Prompt }}`), else None."""
    if not prompt_template:
        return None
    try:
        parts = list(string.Formatter().parse(prompt_template))
    except ValueError:
        return None
    fields = [(name, spec, conv) for _, name, spec, conv in parts if name is not None]
    if len(fields) != 1 or fields[0][1] or fields[0][2]:
        return None
    return "".join(_go_text(literal) + ("{{ .Prompt }}" if name is not None else "")
                   for literal, name, _, _ in parts)


@dataclass(frozen=True)
class Sampling:
    """How Ollama generates: as the run's generation config says, else greedy (temperature
    0), as the evaluate stage measured the model."""

    num_predict: int  #: eval.generation_max_new_tokens
    num_ctx: int | None  #: the trained length, at most the model's positions
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def of(cls, generation_config, num_predict: int, num_ctx: int | None) -> "Sampling":
        if generation_config is None or not getattr(generation_config, "do_sample", False):
            return cls(num_predict, num_ctx)
        return cls(num_predict, num_ctx, float(generation_config.temperature or 1.0),
                   generation_config.top_p, generation_config.top_k)


def modelfile(gguf_file: str, *, tokenizer, chat_template: str | None,
              prompt_template: str | None, sampling: Sampling) -> str:
    """The Modelfile's text for `gguf_file` (a name in the same folder)."""
    lines = ["# Ollama Modelfile written by the export stage (docs/gguf.md):",
             "#   ollama create NAME -f Modelfile && ollama run NAME",
             f"FROM ./{gguf_file}", ""]
    stops = [tokenizer.eos_token] if getattr(tokenizer, "eos_token", None) else []
    layout = chat_layout(tokenizer, chat_template) if chat_template else None
    as_prompt = None if chat_template else prompt_layout(prompt_template)
    if layout is not None:
        lines.append(f"# the run's chat template, in {layout.name}'s layout")
        template = layout.go_template()
        stops += layout.stops
    elif as_prompt is not None:
        lines.append("# the prompt template the run trained on (data.prompt_template), the "
                     "column as .Prompt")
        template = as_prompt
    else:
        lines.append("# the text as typed: " + (
            "the run's chat template is none of the layouts written out here (ChatML, "
            "Llama 3, Gemma); write its TEMPLATE by hand" if chat_template else
            "the run trained on no chat template nor a one-column prompt template"))
        template = "{{ .Prompt }}"
    if '"""' in template:
        lines[-1] = "# the text as typed: the prompt template holds a triple quote"
        template = "{{ .Prompt }}"
    lines += [f'TEMPLATE """{template}"""', ""]
    lines += [f"PARAMETER stop {json.dumps(s, ensure_ascii=False)}"
              for s in dict.fromkeys(stops)]
    lines.append(f"PARAMETER temperature {_number(sampling.temperature)}")
    for key in ("top_p", "top_k", "num_predict", "num_ctx"):
        value = getattr(sampling, key)
        if value is not None:
            lines.append(f"PARAMETER {key} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
