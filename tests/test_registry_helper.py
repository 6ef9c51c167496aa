"""finetune.registry.Registry, the name -> class tables' one helper: registering (also as a
decorator), aliases, built-ins imported only when looked up, `module:Class` references, the
unknown-name line with its did-you-mean, the subclass check; and that the dataset types'
table and the trainer types' wording come out word for word."""

from __future__ import annotations

import sys

import pytest

from finetune.errors import PipelineError
from finetune.registry import Registry


class Base:
    pass


class Alpha(Base):
    pass


class Other:
    pass


BASE_NAME = f"{__name__}.Base"


def test_register_directly_and_as_a_decorator_with_aliases():
    reg = Registry("thing", "thing.kind", base=Base)
    assert reg.register("alpha", Alpha, aliases=("a",)) is Alpha

    @reg.register("beta", aliases=("b", "bee"))
    class Beta(Base):
        pass

    assert reg.get("alpha") is Alpha and reg.get("beta") is Beta
    assert reg.get("a") is Alpha and reg.get("bee") is Beta
    assert reg.names() == ["alpha", "beta"]
    assert reg.aliases() == {"a": "alpha", "b": "beta", "bee": "beta"}
    assert reg.known() == ["alpha", "beta", "a", "b", "bee"]
    assert reg.canonical("bee") == "beta" and reg.canonical("alpha") == "alpha"
    assert "b" in reg and "gamma" not in reg


def test_a_built_in_is_imported_on_first_lookup_only(tmp_path, monkeypatch):
    (tmp_path / "lazy_builtin_mod.py").write_text(
        f"from {__name__} import Base\nclass Lazy(Base):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lazy_builtin_mod" not in sys.modules
    reg = Registry("thing", "thing.kind", base=Base,
                   built_ins={"lazy": "lazy_builtin_mod:Lazy", "alpha": Alpha})
    assert reg.names() == ["lazy", "alpha"] and "lazy" in reg
    reg.get("alpha")
    assert "lazy_builtin_mod" not in sys.modules
    lazy = reg.get("lazy")
    assert "lazy_builtin_mod" in sys.modules and lazy.__name__ == "Lazy"
    assert reg.get("lazy") is lazy  # imported once


def test_a_built_in_that_does_not_import_names_the_key():
    reg = Registry("thing", "thing.kind", built_ins={"gone": "no_such_module_xyz:Gone"})
    with pytest.raises(PipelineError, match=r"^thing.kind: cannot import "
                       r"'no_such_module_xyz:Gone' \(No module named 'no_such_module_xyz'\)$"):
        reg.get("gone")


def test_a_class_named_by_reference_module_or_file(tmp_path, monkeypatch):
    reg = Registry("thing", "thing.kind", base=Base)
    assert reg.get(f"{__name__}:Alpha") is Alpha
    (tmp_path / "own_things.py").write_text(
        f"from {__name__} import Base\nclass Mine(Base):\n    pass\n")
    mine = reg.get(f"{tmp_path}/own_things.py:Mine")
    assert mine.__name__ == "Mine" and issubclass(mine, Base)
    assert reg.canonical(f"{__name__}:Alpha") == f"{__name__}:Alpha"
    assert reg.names() == []  # a reference is looked up, not registered
    with pytest.raises(PipelineError, match=r"^thing.kind: cannot import "
                       rf"'{__name__}:Nope' \(module '{__name__}' has no attribute 'Nope'\)$"):
        reg.get(f"{__name__}:Nope")


def test_an_unknown_name_is_one_line_with_the_closest_and_the_known_names():
    reg = Registry("thing", "thing.kind", built_ins={"beta": "m:B"})
    reg.register("alpha", Alpha, aliases=("first",))
    with pytest.raises(PipelineError) as caught:
        reg.get("alhpa")
    assert str(caught.value) == ("thing.kind 'alhpa': no such thing (registered: alpha, beta; "
                                 "or name a class as 'module:Class') (did you mean 'alpha'?)")
    with pytest.raises(PipelineError) as caught:  # nothing close: no hint
        reg.canonical("zzz")
    assert str(caught.value) == ("thing.kind 'zzz': no such thing (registered: alpha, beta; "
                                 "or name a class as 'module:Class')")
    with pytest.raises(PipelineError, match=r"\(did you mean 'first'\?\)$"):  # aliases count
        reg.get("firts")


def test_the_message_and_error_type_are_the_callers():
    reg = Registry("thing", "t.kind", error=KeyError, hint="maybe {}? ",
                   unknown="{label} {name!r} unknown ({hint}{names} | {aliases})")
    reg.register("beta", Alpha)
    reg.register("alpha", Alpha, aliases=("a",))
    with pytest.raises(KeyError) as caught:
        reg.get("alpah")
    assert caught.value.args[0] == "thing 'alpah' unknown (maybe alpha? beta, alpha | a = alpha)"


def test_a_class_that_is_not_a_subclass_of_the_base_is_refused():
    reg = Registry("thing", "thing.kind", base=Base)
    reg.register("other", Other)
    reg.register("instance", Alpha())
    with pytest.raises(PipelineError) as caught:
        reg.get("other")
    assert str(caught.value) == f"thing.kind 'other': {Other!r} is not a subclass of {BASE_NAME}"
    with pytest.raises(PipelineError, match=r"^thing.kind 'instance': <.*Alpha object at .*> "
                       rf"is not a subclass of {BASE_NAME}$"):
        reg.get("instance")
    with pytest.raises(PipelineError, match=rf"^thing.kind '{__name__}:Other': .* is not a "
                       "subclass of"):
        reg.get(f"{__name__}:Other")


def test_the_base_may_be_resolved_at_lookup():
    """The trainer types' base (TrainingRun) is itself registered, as `sft`, after the table
    is made: a callable (or a 'module:Class' string) is resolved when a name is looked up."""
    reg = Registry("trainer", "training.type", base=lambda: reg.get("root", check=False))
    reg.register("alpha", Alpha)
    reg.register("root", Base)  # registered after "alpha", looked up when "alpha" is
    assert reg.get("alpha") is Alpha
    reg.register("other", Other)
    with pytest.raises(PipelineError, match=rf"is not a subclass of {BASE_NAME}$"):
        reg.get("other")
    by_ref = Registry("thing", "thing.kind", base=f"{__name__}:Base")
    by_ref.register("other", Other)
    assert by_ref.base_class() is Base
    with pytest.raises(PipelineError, match=rf"is not a subclass of {BASE_NAME}$"):
        by_ref.get("other")


def test_the_trainer_types_wording_word_for_word():
    """engine/recipe/trainers.py's messages, as the table configured in its place writes them
    (hint="": its unknown-name line has no did-you-mean yet)."""
    reg = Registry("trainer", "training.type", base=lambda: reg.get("sft", check=False),
                   built_ins={"dpo": "no_such_engine_module:DPORun"}, hint="")
    reg.register("sft", Base)
    with pytest.raises(PipelineError) as caught:
        reg.get("ppo")
    assert str(caught.value) == ("training.type 'ppo': no such trainer (registered: dpo, sft; "
                                 "or name a class as 'module:Class')")
    with pytest.raises(PipelineError) as caught:
        reg.get(f"{__name__}:Other")
    assert str(caught.value) == (f"training.type '{__name__}:Other': {Other!r} is not a "
                                 f"subclass of {BASE_NAME}")


def test_the_dataset_types_table_keeps_its_wording():
    from finetune.datatypes.registry import DATASET_TYPES, canonical, type_class

    assert DATASET_TYPES.names() == ["completion", "text", "chat", "classification",
                                     "preference", "prompt", "seq2seq", "unpaired_preference",
                                     "vision_chat", "vision_preference"]
    assert canonical("sharegpt") == "chat" and type_class("seq_completion").name == "completion"
    with pytest.raises(ValueError) as caught:
        canonical("chta")
    assert str(caught.value) == (
        "unknown dataset type 'chta' (did you mean 'chat'? types: completion, text, chat, "
        "classification, preference, prompt, seq2seq, unpaired_preference, vision_chat, "
        "vision_preference; aliases: "
        "seq_completion = completion, "
        "conversational = chat, sharegpt = chat, seq_classification = classification, "
        "text_classification = "
        "classification, dpo = preference, pairwise = preference, unpaired = "
        "unpaired_preference, kto = unpaired_preference, vision = vision_chat, vision_dpo = "
        "vision_preference; or a project's own as "
        "'module:Class')")
    with pytest.raises(ValueError) as caught:
        canonical("finetune.config.data:DataConfig")
    assert str(caught.value) == ("'finetune.config.data:DataConfig' is not a "
                                 "finetune.datatypes.DatasetType subclass")
    with pytest.raises(ValueError) as caught:  # load_object's line, the key's prefix dropped
        canonical("finetune.config.data:Nope")
    assert str(caught.value) == ("cannot import 'finetune.config.data:Nope' (module "
                                 "'finetune.config.data' has no attribute 'Nope')")
