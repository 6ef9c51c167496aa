"""The `DatasetType` interface: everything the pipeline needs to know about one kind of row.

A dataset type owns its rows from the raw file to the metrics: which data keys it reads and
their rules (config), which raw columns it needs (download's contract), how a raw row becomes a
formatted row and which rows have nothing to learn (format), how a formatted row becomes tokens
with its label mask (tokenize, and the stream, which chains the two), what the evaluate stage
prompts with, compares against and reports, and which model it trains (`task`: export, the
model class and the engine's loss follow from it). The stages ask the type; none of them knows
a type's name.

A type is one module: a subclass with a `name`, its `keys`, and `format` and `encoder`.
Built-in types are listed in finetune.datatypes.registry; a project's own is named in the
params file as `module:Class` (or `path/to/file:Class`) like the other extension points.
Configs are not imported here (the config imports this package): `data` is the validated
`finetune.config.data.DataConfig` of one source.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from finetune.datatypes.encoding import bos_prefix_id
from finetune.errors import PipelineError

#: a tokenize map function: (batch of formatted columns, tok=..., **kwargs) -> encoded columns
Encoder = Callable[..., dict[str, list]]


@dataclass(frozen=True)
class ModelTask:
    """The model a type trains, as the config sees it: what loads it, what PEFT adapts, how
    it is served, and the engine's model kind that trains it (engine.kinds: its batches, loss
    and checks). The two flags are what the config's compatibility rows need before any
    engine code runs; the engine asks the kind instead."""

    auto_class: str
    peft_task_type: str
    pipeline_tag: str
    #: one label per row (its class id, on the last token): a classification head, the class
    #: names next to the data and the weights, predictions instead of generations
    classifier: bool
    #: an encoder-decoder model (T5-style): the prompt goes to the encoder and the labels are
    #: the completion alone, the decoder's own positions (no next-token shift), batched with
    #: their own padding and the decoder's inputs (engine.kinds.seq2seq_lm)
    encoder_decoder: bool = False
    #: the engine's model kind (engine.kinds.KINDS: a registered name or 'module:Class')
    kind: str = "causal_lm"
    #: its rows of the config's compatibility table, declared here beside the kind
    #: (finetune.config.compat makes one row of each, checked where the dataset trains this
    #: kind): (the key refused, when it counts as set (None: set at all), why, what an example
    #: params file sets besides `selected_by`)
    refuses: tuple = field(default=(), compare=False)
    #: how those rows name the kind ("an encoder-decoder model (...)")
    described: str = ""
    #: the keys a params file sets to train this kind, for the rows' examples
    selected_by: dict = field(default_factory=dict, compare=False)


CAUSAL_LM = ModelTask("AutoModelForCausalLM", "CAUSAL_LM", "text-generation", False)

#: settings a sequence classifier does not combine with (ModelTask.refuses)
_CLASSIFIER_REFUSES = (
    ("training.packing", None, "its sequence classifier reads one labelled text a row",
     {"training.packing": True}),
    ("training.padding_free", None, "its sequence classifier reads one labelled text a row",
     {"training.padding_free": True}),
    ("training.use_liger_kernel", None,
     "Liger's fused loss is for a vocabulary head; a classifier's head has classes",
     {"training.use_liger_kernel": True}),
    ("training.fused_loss_factory", None,
     "a fused loss is for a vocabulary head; a classifier's head has classes",
     {"training.fused_loss_factory": "m:f"}),
    ("eval.generation_metrics", None,
     "a classifier does not generate; it reports accuracy and macro_f1",
     {"eval.generation_metrics": ["rouge"]}),
    ("eval.harness.tasks", lambda c: bool(c.eval.harness.tasks),
     "lm-eval scores a language model's text; a classifier's head has classes",
     {"eval.harness.tasks": ["arc_easy"]}),
    ("training.loss_chunk_tokens",
     lambda c: c.training.loss_chunk_tokens not in (
         None, type(c.training).model_fields["loss_chunk_tokens"].default),
     "it chunks a vocabulary head, which a classifier has none of; remove it",
     {"training.loss_chunk_tokens": 1024}),
    ("training.construct_model_on", lambda c: c.training.construct_model_on == "meta",
     "a new classification head is initialised, not read; use construct_model_on: default "
     "or device", {"training.construct_model_on": "meta"}),
    ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
     "the pipeline's stages are a causal LM's decoder layers and head",
     {"distributed.strategy": "pipeline", "distributed.nproc_per_node": 2}),
)
SEQUENCE_CLASSIFICATION = ModelTask(
    "AutoModelForSequenceClassification", "SEQ_CLS", "text-classification", True,
    kind="sequence_classifier", refuses=_CLASSIFIER_REFUSES,
    described="a classification dataset",
    selected_by={"data.dataset_type": "classification", "data.prompt_template": None,
                 "data.completion_template": None, "eval.generation_metrics": []})

#: settings an encoder-decoder model does not combine with (ModelTask.refuses)
_ENCODER_DECODER_REFUSES = (
    ("registry.register_model", None,
     "MLflow logs a transformers pipeline, and transformers 5 has none for an "
     "encoder-decoder model (text2text-generation was removed); set it to false (the "
     "export folder is still written)", {"registry.register_model": True}),
    ("training.packing", None, "its prompts and completions are batched apart, one a row",
     {"training.packing": True}),
    ("training.padding_free", None,
     "its prompts and completions are batched apart, one a row",
     {"training.padding_free": True}),
    ("training.use_liger_kernel", None,
     "Liger's fused loss is wired for decoder-only models", {"training.use_liger_kernel": True}),
    ("training.fused_loss_factory", None,
     "a fused loss is probed on a decoder-only forward", {"training.fused_loss_factory": "m:f"}),
    ("training.compute_loss_func", None,
     "its loss is the decoder's unshifted cross entropy", {"training.compute_loss_func": "m:f"}),
    ("data.collate_fn", lambda c: c.data.user_collate_fn is not None,
     "its batches carry the decoder's inputs (engine.kinds.seq2seq_lm.collate_seq2seq)",
     {"data.collate_fn": "m:f"}),
    ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
     "the pipeline splits a decoder-only stack", {"distributed.strategy": "pipeline",
                                                  "distributed.nproc_per_node": 2}),
    ("eval.harness.tasks", lambda c: bool(c.eval.harness.tasks),
     "lm-eval's tasks here score decoder-only models", {"eval.harness.tasks": ["arc_easy"]}),
    ("training.loss_chunk_tokens",
     lambda c: c.training.loss_chunk_tokens not in (
         None, type(c.training).model_fields["loss_chunk_tokens"].default),
     "its loss is the decoder's full cross entropy; remove it",
     {"training.loss_chunk_tokens": 1024}),
)
SEQ_2_SEQ_LM = ModelTask(
    "AutoModelForSeq2SeqLM", "SEQ_2_SEQ_LM", "text2text-generation", False,
    encoder_decoder=True, kind="seq2seq_lm", refuses=_ENCODER_DECODER_REFUSES,
    described="an encoder-decoder model (data.dataset_type seq2seq)",
    selected_by={"data.dataset_type": "seq2seq", "registry.register_model": False})

#: settings a vision-language model does not combine with yet (ModelTask.refuses)
_VISION_REFUSES = (
    ("training.packing", None, "a packed row would hold several rows' images, which the "
     "model cannot keep apart", {"training.packing": True}),
    ("training.padding_free", None, "its images are matched to their rows by the batch's "
     "rows", {"training.padding_free": True}),
    ("training.use_liger_kernel", None, "Liger's patches are for text-only models",
     {"training.use_liger_kernel": True}),
    ("training.fused_loss_factory", None, "a fused loss is probed on a text-only forward",
     {"training.fused_loss_factory": "m:f"}),
    ("data.collate_fn", lambda c: c.data.user_collate_fn is not None,
     "its batches carry the images' pixel values (engine.kinds.image_text_to_text)",
     {"data.collate_fn": "m:f"}),
    ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
     "the pipeline splits a text-only decoder stack", {"distributed.strategy": "pipeline",
                                                       "distributed.nproc_per_node": 2}),
    ("eval.harness.tasks", lambda c: bool(c.eval.harness.tasks),
     "lm-eval's tasks here score text-only models", {"eval.harness.tasks": ["arc_easy"]}),
    ("export.gguf", lambda c: bool(getattr(c.export, "gguf", None)),
     "the GGUF writer converts text-only models (llama.cpp keeps a vision tower in a separate "
     "mmproj file, not written here)", {"export.gguf": ["f16"]}),
)
IMAGE_TEXT_TO_TEXT = ModelTask(
    "AutoModelForImageTextToText", "CAUSAL_LM", "image-text-to-text", False,
    kind="image_text_to_text", refuses=_VISION_REFUSES,
    described="a vision-language model (data.dataset_type vision_chat)",
    selected_by={"data.dataset_type": "vision_chat"})

#: the model kinds a dataset type can train, whose rows the compatibility table holds
MODEL_TASKS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION, SEQ_2_SEQ_LM, IMAGE_TEXT_TO_TEXT)

#: why an encoder-decoder model needs the seq2seq type, for the model loader's refusal
ENCODER_DECODER_WHY = (
    "an encoder-decoder (T5-style) model reads the prompt in its encoder and takes the "
    "completion alone as labels, unshifted; it trains with data.dataset_type seq2seq "
    "(AutoModelForSeq2SeqLM, peft.task_type SEQ_2_SEQ_LM), and a decoder-only model with the "
    "other types")


#: what a dataset type's rows can give a method to train on (DatasetType.targets)
TARGETS = ("tokens", "pairs", "unpaired", "labels", "none")


def requires_trainable(targets: str) -> bool:
    """Whether a tokenized row must hold a trained token (every kind but a prompt-only row,
    whose completion the method makes during training)."""
    if targets not in TARGETS:
        raise ValueError(f"dataset type targets '{targets}': not one of {', '.join(TARGETS)}")
    return targets != "none"


@dataclass
class DataContext:
    """What a stage hands a type: the project root (template and function files), the
    tokenizer (loaded on first use: most types format without one), for a classifier the
    class names in id order, and the processor the model kind encodes inputs with (a
    vision-language model's turns images into pixel values; for a text model it is the
    tokenizer)."""

    root: Path
    load_tokenizer: Callable[[], Any]
    labels: list[str] | None = None
    #: tokenizer -> the model kind's processor (engine.kinds: ModelKind.processor); None: the
    #: tokenizer is the processor
    load_processor: Callable[[Any], Any] | None = None
    #: -> the tools the method's rollouts call (finetune.config.methods: prompt_tools), as
    #: the schemas rendered into prompts that name no tools of their own (None: none); asked
    #: only by a type that renders prompts, so other stages and types never read the keys
    load_tools: Callable[[], list[dict] | None] | None = None
    _tools: Any = field(default=False, repr=False)
    _tokenizer: Any = field(default=None, repr=False)
    _processor: Any = field(default=None, repr=False)
    _bos: Any = field(default=False, repr=False)

    @property
    def tools(self) -> list[dict] | None:
        """Loaded on first use."""
        if self._tools is False:
            self._tools = self.load_tools() if self.load_tools else None
        return self._tools

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.load_tokenizer()
        return self._tokenizer

    @property
    def processor(self):
        """Loaded on first use, around the tokenizer."""
        if self._processor is None:
            self._processor = (self.load_processor(self.tokenizer) if self.load_processor
                               else self.tokenizer)
        return self._processor

    @property
    def bos(self) -> int | None:
        """BOS to prepend to every sequence (None when the tokenizer adds none)."""
        if self._bos is False:
            self._bos = bos_prefix_id(self.tokenizer)
        return self._bos


@dataclass
class Formatted:
    """A split after the format step: the rows kept, in order, and the row numbers dropped for
    having nothing to learn (empty completion, empty assistant turn, no label)."""

    rows: Any  # pandas.DataFrame with at least prompt and completion (evaluate reads them)
    dropped: list[int]
    #: why the dropped rows have nothing to learn, for the count's message
    reason: str = "nothing to train on"
    #: row number -> why that row was dropped, where rows are dropped for several reasons
    #: (a row contract's rule with its detail, or nothing to learn)
    reasons: dict[int, str] | None = None

    @classmethod
    def with_reasons(cls, rows, reasons: dict[int, str]) -> "Formatted":
        """Rows kept, and the rows dropped with why each was: the count's message gives the
        reasons with their counts, and `first` names the first row and its reason."""
        from collections import Counter

        kinds = Counter(r.split(" (")[0] for r in reasons.values())
        summary = "; ".join(f"{kind} ({n})" if len(kinds) > 1 else kind
                            for kind, n in kinds.most_common())
        return cls(rows, sorted(reasons), summary or "nothing to train on", dict(reasons))

    @property
    def first(self) -> str | None:
        """The first dropped row, as the count's message names it (with its reason where
        rows are dropped for several)."""
        if not self.dropped:
            return None
        row = self.dropped[0]
        return f"{row}, {self.reasons[row]}" if self.reasons else str(row)

    @classmethod
    def without_empty(cls, rows, first_row: int, reason: str) -> "Formatted":
        """Prompt/completion rows minus those whose completion is empty or whitespace only
        (nothing to learn)."""
        empty = rows["completion"].str.strip() == ""
        dropped = [first_row + int(i) for i in rows.index[empty]]
        return cls(rows[~empty].reset_index(drop=True), dropped, reason)


class DatasetType(ABC):
    """One kind of row. Subclasses set `name`, `keys` (and `aliases`, `task` where they differ)
    and implement `format` and `encoder` (abstract: a type without them is refused when the
    params name it); the rest has defaults that fit prompt/completion rows."""

    #: the value of data.dataset_type
    name: ClassVar[str] = ""
    #: other names users write for it (QEfficient's `seq_completion`)
    aliases: ClassVar[tuple[str, ...]] = ()
    #: the data keys only this type reads; another type's key set in a params file is a
    #: conflict, not silently ignored
    keys: ClassVar[tuple[str, ...]] = ()
    task: ClassVar[ModelTask] = CAUSAL_LM
    #: what a tokenized row gives a method to train on (TARGETS): trained tokens, a
    #: chosen/rejected pair, a completion labelled desirable or not, a class label, or nothing (a prompt a method completes itself).
    #: A trainer type declares which it accepts (finetune.config.methods); the tokenize stage and the
    #: row contract ask `requires_trainable` instead of assuming a trained token in every row.
    targets: ClassVar[str] = "tokens"
    #: the advice when the configured trainer type does not train on these targets (None: the
    #: trainer type's own advice)
    trainer_hint: ClassVar[str | None] = None
    #: why a tokenized row can have no trainable token (the tokenize stage's drop message)
    untrainable: ClassVar[str] = "prompt fills max_seq_length or completion empty"
    #: each tokenized row's labels have one entry per input token (the tokenize contract);
    #: not so where the labels are a decoder's own sequence (seq2seq)
    labels_aligned: ClassVar[bool] = True

    def __init__(self, data):
        self.data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- config ------------------------------------------------------------------------------
    def check(self) -> None:
        """Rules among this type's own keys, run when the params file is validated; raise
        ValueError with one line naming the key."""

    def prepare(self, ctx: DataContext) -> None:
        """Load what the type reads besides rows (functions, template files), so `finetune
        validate` finds a missing one before any stage runs."""

    # -- download ----------------------------------------------------------------------------
    def required_columns(self) -> list[str]:
        """Raw columns the type reads, required present and non-null in every split (empty:
        found while formatting, e.g. an auto-detected text column)."""
        return []

    def nullable_columns(self) -> tuple[str, ...]:
        """Required columns whose nulls mark rows the format step drops and counts."""
        return ()

    # -- format ------------------------------------------------------------------------------
    @abstractmethod
    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Raw rows (a pandas DataFrame) -> formatted rows: `prompt` and `completion` (what
        evaluate prompts with and compares against) and whatever the encoder reads. Rows with
        nothing to learn are dropped and reported in `Formatted.dropped`; a row that cannot
        be one at all (wrong type, unknown label) is a PipelineError naming split and row.
        `first_row`: the number of the frame's first row (a stream formats chunk by chunk)."""

    def formatted_schema(self):
        """The pandera contract of formatted rows."""
        from finetune.datatypes.contract import pair_schema

        return pair_schema(empty_prompt=False)

    def label_values(self, train) -> list[str] | None:
        """A classifier's labels as they occur in a raw train split (the label map is made
        from every training source's); None: the type has no labels."""
        return None

    # -- tokenize ----------------------------------------------------------------------------
    @abstractmethod
    def encoder(self, ctx: DataContext) -> tuple[Encoder, dict[str, Any]]:
        """The tokenize map function and its arguments besides `tok`: a module-level function
        (datasets may run it in worker processes) and JSON-able kwargs (they are part of the
        tokenized split's fingerprint). It returns finetune.datatypes.encoding's columns."""

    # -- stream ------------------------------------------------------------------------------
    def examples(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> list[dict]:
        """Raw rows -> training examples, as format then tokenize would make them (rows with
        nothing to learn, or no trainable token after truncation, left out): the streamed
        train split's form of the type."""
        formatted = self.format(frame, split, ctx, first_row)
        fn, kwargs = self.encoder(ctx)
        enc = fn(formatted.rows.to_dict("list"), tok=ctx.tokenizer, **kwargs)
        keep_all = not requires_trainable(self.targets)  # prompt-only rows train no token
        return [{"input_ids": ids, "labels": labels}
                for ids, labels, n in zip(enc["input_ids"], enc["labels"], enc["n_trainable"])
                if n or keep_all]

    # -- evaluate ----------------------------------------------------------------------------
    def eval_rows(self, formatted):
        """The evaluate stage's prompts and references (columns `prompt`, `reference`) from a
        formatted test split."""
        return formatted[["prompt", "completion"]].rename(columns={"completion": "reference"})

    def reported_metrics(self) -> tuple[str, ...]:
        """Every metric the evaluate stage can report for this type (registry.gate_metric
        names one of them)."""
        from finetune.datatypes.metrics import GENERATION_METRICS, ROUGE_KEYS

        named = tuple(m for m in GENERATION_METRICS if m not in ("rouge", "tool_calls"))
        return ("loss", "perplexity", *named, *ROUGE_KEYS)

    def score(self, predictions: list, references: list, ev, ctx: DataContext
              ) -> dict[str, float]:
        """Metrics of one model's predictions (generated texts, or class ids for a
        classifier) against the references; `ev`: the eval section. By default each is the
        mean of its `row_scores`."""
        from finetune.datatypes.metrics import means

        return means(self.row_scores(predictions, references, ev, ctx))

    def row_scores(self, predictions: list, references: list, ev, ctx: DataContext
                   ) -> dict[str, list[float]]:
        """The per-row values of the metrics that are means over rows (the evaluate stage's
        bootstrap stderr resamples them); a metric of the whole set (macro-F1) has none."""
        from finetune.datatypes.metrics import generation_rows

        return generation_rows(ev.generation_metrics, predictions, references, ev.answer_regex)

    # -- export ------------------------------------------------------------------------------
    def serving_chat_template(self, tok, root: Path) -> str | None:
        """The chat template the trained tokenizer should carry, so the exported model
        formats conversations as it was trained to (None: the tokenizer's own stays)."""
        return None

    # -- the source of a type's code, for fingerprints ----------------------------------------
    @classmethod
    def source_files(cls) -> list[Path]:
        """The files whose code decides this type's output (its class and its bases'), so a
        change to any of them changes the tokenized split's fingerprint."""
        import inspect

        files = []
        for klass in cls.__mro__:
            if klass is object:
                continue
            try:
                files.append(Path(inspect.getfile(klass)))
            except TypeError:
                continue
        return list(dict.fromkeys(files))


def class_names(values: set[str], given: list[str] | None) -> list[str]:
    """The label map, in id order: `data.labels`, else the distinct labels found (numeric order
    when every label is an integer, else alphabetical)."""
    if given:
        return list(given)
    numeric = all(v.lstrip("-").isdigit() for v in values)
    names = sorted(values, key=(lambda v: int(v)) if numeric else None)
    if len(names) < 2:
        raise PipelineError(f"data.label_column: the train split has {len(names)} class(es) "
                            f"({', '.join(map(repr, names))}); a classifier needs two or more")
    return names
