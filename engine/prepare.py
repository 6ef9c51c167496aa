"""The data stages' door into the engine (format, tokenize, the train stage's stream): the
tokenizer and the model kind's processor around it, the model's positions, and the class-name
file a classifier's rows are numbered by.

tasks/ modules that prepare rows import this module and no other engine module
(tests/test_layering.py), so where the engine keeps these (engine.modeling, engine.kinds,
engine.datapath) can change without an edit to a stage, and `finetune validate`, which runs the
data stages' checks, reaches the engine through doors only.
"""

from __future__ import annotations

from engine.kinds import kind_of
from engine.modeling.labels import read_labels, write_labels
from engine.modeling.model import load_tokenizer, max_positions

__all__ = ["kind_of", "load_tokenizer", "max_positions", "read_labels", "rollout_tool_schemas",
           "tool_schemas", "write_labels"]


def tool_schemas(refs: list[str], key: str) -> list[dict]:
    """The chat-template schemas of the tool functions `refs` ('module:function', named in the
    params under `key`), in order: what a prompt offers the model (engine.rollout.tools)."""
    from engine.rollout.tools import load_tools, tool_schema

    return [tool_schema(function, f"{key}[{i}]")
            for i, function in enumerate(load_tools(refs, key).values())]


def rollout_tool_schemas(refs: list[str], environments: str | dict[str, str] | None,
                         section: str) -> list[dict] | dict[str, list[dict]] | None:
    """What a method's prompts offer the model: the schemas of its tool functions
    (`SECTION.tools`) and, with `SECTION.environment_factory`, its environment's methods after
    them (engine.rollout.environment), as one list for every row, or per environment name for a
    mapping (each row's `environment` column chooses); None when it names neither."""
    if not environments:
        return tool_schemas(refs, f"{section}.tools") if refs else None
    from engine.rollout.environment import load_environments
    from engine.rollout.tools import load_tools

    functions = load_tools(refs or [], f"{section}.tools")
    loaded = load_environments(environments, f"{section}.environment_factory", functions)
    return loaded.schemas if loaded.named else loaded.schemas[None]


def teacher_scores(teacher_dir, teacher_ref: str, student_tok, student_ref: str, split,
                   top_k: int, temperature: float):
    """The teacher stage's scoring (offline distillation, engine.recipe.distill.score): the
    teacher's tokenizer checked against the student's (one line naming both), then (datasets
    features of the columns, an iterator of their batches): the teacher's top-k ids and
    log-probabilities at every trained token of the tokenized `split`, a few rows at a time."""
    from engine.recipe.distill.score import features, score_split
    from engine.recipe.distill.teacher import check_same_vocabulary

    check_same_vocabulary(teacher_dir, teacher_ref, student_tok, student_ref)
    return features(), score_split(teacher_dir, split, top_k, temperature,
                                   student_tok.pad_token_id)
