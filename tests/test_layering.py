"""The architecture as a test: imports go one way (flows -> tasks -> engine -> finetune), no
module imports another that imports it back (lazy, in-function imports count too), and the
engine knows nothing of the pipeline's folder layout."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

FLOORS = {"finetune": 0, "engine": 1, "tasks": 2, "flows": 3}

# The engine's rooms, lowest first: a room imports its own modules and lower rooms only. The
# doors (engine.preflight for the validate and train stages, engine.worker for torchrun,
# engine.prepare for the data stages, engine.evaluate for the evaluate stage, engine.export for
# the export stage) sit above them all. A model kind owns its collator and loss (above
# datapath and objective) and is asked by evaluation and everything above it. The rollout
# (generation and rewards) serves the methods' rooms in recipe/ and the evaluate stage, and
# needs nothing of the strategies.
ENGINE_ROOMS = ["process", "reporting", "modeling", "datapath", "objective", "kinds",
                "evaluation", "rollout", "strategies", "state", "recipe"]
ENGINE_DOORS = {"engine", "engine.preflight", "engine.worker", "engine.prepare",
                "engine.evaluate", "engine.export"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body."""
    modules = {_module(p): p for pkg in FLOORS for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                # `from engine.state import checkpoint` imports the submodule engine.state.checkpoint
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_imports_go_one_way():
    upward = [(mod, dep) for mod, deps in _imports().items() for dep in deps
              if FLOORS[dep.split(".")[0]] > FLOORS[mod.split(".")[0]]]
    assert upward == []


def test_no_import_cycles():
    graph = _imports()
    # package __init__ files re-export their own submodules: that is not a cycle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _room(module: str) -> int:
    """The rank of an engine module's room; the doors rank above every room."""
    if module in ENGINE_DOORS:
        return len(ENGINE_ROOMS)
    return ENGINE_ROOMS.index(module.split(".")[1])


def test_every_engine_module_is_in_a_room_or_is_a_door():
    engine = [m for m in _imports() if m.startswith("engine")]
    homeless = [m for m in engine if m not in ENGINE_DOORS
                and (m.count(".") < 1 or m.split(".")[1] not in ENGINE_ROOMS)]
    assert len(engine) > 40 and homeless == []


def test_engine_rooms_import_downward():
    """A room never imports a higher room or a door: the data path knows nothing of the
    strategies, the strategies nothing of the recipe, and so on up."""
    upward = sorted((mod, dep) for mod, deps in _imports().items() if mod.startswith("engine.")
                    for dep in deps if dep.startswith("engine") and _room(dep) > _room(mod))
    assert upward == []


def _private_reaches(source: str, me: str) -> list[str]:
    """`from engine.x.y import _name`, or `alias._name` on an imported engine module, where
    the target is in another room than module `me`: another room's private name."""
    own = me.split(".")[1] if me not in ENGINE_DOORS else None
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            room = node.module.split(".")[1] if "." in node.module else None
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if (ROOT / (target.replace(".", "/") + ".py")).exists():
                    aliases[a.asname or a.name] = target
                elif a.name.startswith("_") and room != own:
                    found.append(f"{me}: {target}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("engine.") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id].split(".")[1] != own):
            found.append(f"{me}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_room_reaches_into_another_rooms_private_names():
    found = [hit for path in (ROOT / "engine").rglob("*.py")
             for hit in _private_reaches(path.read_text(), _module(path))]
    assert found == []


def test_the_private_name_check_sees_a_reach():
    """The check above is not vacuous: it flags both forms of reaching in, and lets a room
    use its own private names."""
    source = ("from engine.objective.loss import _x\n"
              "from engine.objective import loss as L\nL._y\n")
    assert _private_reaches(source, "engine.recipe.run") == [
        "engine.recipe.run: engine.objective.loss._x",
        "engine.recipe.run: engine.objective.loss._y"]
    assert _private_reaches(source, "engine.objective.liger") == []


def test_the_engine_does_not_know_the_pipeline_layout():
    graph = _imports()
    assert [m for m, deps in graph.items() if m.startswith("engine")
            and "finetune.workspace" in deps] == []
    for path in (ROOT / "engine").rglob("*.py"):
        assert "data/" not in path.read_text(), path


def _members_called_on_a_strategy() -> dict[str, set[str]]:
    """member -> the modules outside engine/strategies/ that use it on a strategy object
    (`strategy.X`, `self.strategy.X`, `built.strategy.X`)."""
    used: dict[str, set[str]] = {}
    for pkg in ("engine", "tasks", "flows"):
        for path in (ROOT / pkg).rglob("*.py"):
            if "strategies" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value
                if ((isinstance(owner, ast.Name) and owner.id == "strategy")
                        or (isinstance(owner, ast.Attribute) and owner.attr == "strategy")):
                    used.setdefault(node.attr, set()).add(_module(path))
    return used


def test_the_strategy_interface_declares_what_is_called_on_it_and_no_flag_is_read():
    """Everything the loop, model setup and checkpoint code call on a strategy is declared on
    `Strategy` (each strategy inherits or overrides it), and none of it is a flag the caller
    branches on (a bool class attribute): behaviour lives in the strategies."""
    import importlib

    from engine.strategies.base import Strategy

    for name in ("ddp", "fsdp2", "diloco", "pipeline"):
        importlib.import_module(f"engine.strategies.{name}")

    used = _members_called_on_a_strategy()
    assert {"forward_backward", "loss_divisor", "wrap", "dcp_state"} <= set(used)
    undeclared = {m: sorted(w) for m, w in used.items() if not hasattr(Strategy, m)}
    assert undeclared == {}
    flags = {m: sorted(w) for m, w in used.items()
             if isinstance(getattr(Strategy, m), bool)}
    assert flags == {}
    strategies = [Strategy, *Strategy.__subclasses__()]
    assert len(strategies) >= 5
    for klass in strategies:
        assert all(hasattr(klass, m) for m in used), klass


def _strategy_name_branches(source: str) -> list[str]:
    """Comparisons (and `match` statements) on a strategy's name: `strategy.name`,
    `self.strategy.name`, `built.strategy.name` compared with anything."""
    def names_a_strategy(node) -> bool:
        owner = node.value if isinstance(node, ast.Attribute) and node.attr == "name" else None
        return ((isinstance(owner, ast.Name) and owner.id == "strategy")
                or (isinstance(owner, ast.Attribute) and owner.attr == "strategy"))

    found = []
    for node in ast.walk(ast.parse(source)):
        operands = ((node.left, *node.comparators) if isinstance(node, ast.Compare)
                    else (node.subject,) if isinstance(node, ast.Match) else ())
        if any(names_a_strategy(o) for o in operands):
            found.append(node.lineno)
    return [f"line {n}" for n in sorted(found)]


def test_no_branch_on_a_strategy_name_outside_the_strategies():
    """What differs by strategy is a member the strategy declares (`Strategy`, overridden
    where it differs), not a comparison of its name elsewhere: a new strategy then answers
    for itself instead of falling into another's branch. The name may still be printed."""
    found = {_module(p): hits for pkg in ("engine", "tasks", "flows")
             for p in (ROOT / pkg).rglob("*.py") if "strategies" not in p.parts
             if (hits := _strategy_name_branches(p.read_text()))}
    assert found == {}


def test_the_strategy_name_check_sees_a_branch():
    """The check above is not vacuous: it flags ==, `in` and `match` on the name, and not a
    message that prints it nor another object's name."""
    source = ("if self.strategy.name == 'single': pass\n"
              "ok = strategy.name in ('ddp', 'fsdp2')\n"
              "print(f'strategy {self.strategy.name}')\n"
              "same = model.name == 'x'\n"
              "match run.strategy.name:\n    case 'diloco': pass\n")
    assert _strategy_name_branches(source) == ["line 1", "line 2", "line 5"]


def test_only_the_single_process_strategy_shares_a_prompt_forward():
    """GRPO's shared prompt forward, once a branch on `strategy.name == "single"` in its run,
    is each strategy's declared answer, the same one: the one-process strategy only (DDP and
    FSDP2 at world size 1 run as it)."""
    import importlib

    from engine.strategies.base import Strategy

    classes = [Strategy, *(vars(importlib.import_module(f"engine.strategies.{m}"))[c]
                           for m, c in (("ddp", "DDPStrategy"), ("fsdp2", "FSDP2Strategy"),
                                        ("diloco", "DiLoCoStrategy"),
                                        ("pipeline", "PipelineStrategy")))]
    answers = {k.name: k.shares_prompt_forward(object.__new__(k)) for k in classes}
    assert answers == {"single": True, "ddp": False, "fsdp2": False, "diloco": False,
                       "pipeline": False}


def test_the_train_stage_enters_the_engine_through_one_door():
    """tasks/train.py reaches the engine through engine.preflight only: a new check before
    launch is added in the engine, not in the stage."""
    engine_deps = {d for d in _imports()["tasks.train"] if d.startswith("engine.")}
    assert engine_deps == {"engine.preflight"}


def test_the_evaluate_stage_enters_the_engine_through_one_door():
    """tasks/evaluate.py reaches the engine through engine.evaluate only: what a method
    measures on held-out data is its run class's `heldout_metrics`, not a branch here."""
    engine_deps = {d for d in _imports()["tasks.evaluate"] if d.startswith("engine.")}
    assert engine_deps == {"engine.evaluate"}


def _engine_reached(stage: str, graph: dict[str, set[str]] | None = None
                    ) -> dict[str, list[str]]:
    """The engine modules a stage module reaches, directly or through other tasks modules
    (lazy imports too): module -> the chain of tasks modules that leads to it."""
    graph, reached, seen = graph or _imports(), {}, {stage}
    todo = [(stage, [stage])]
    while todo:
        module, chain = todo.pop()
        for dep in sorted(graph[module]):
            if dep.split(".")[0] == "engine":
                reached.setdefault(dep, chain)
            elif dep.startswith("tasks") and dep not in seen:
                seen.add(dep)
                todo.append((dep, chain + [dep]))
    return reached


def _side_entrances(stage: str, graph: dict[str, set[str]] | None = None) -> dict:
    return {m: c for m, c in _engine_reached(stage, graph).items() if m not in ENGINE_DOORS}


def test_the_evaluate_stage_reaches_the_engine_through_doors_only():
    """Transitively too: the tasks modules the evaluate stage uses (model references, MLflow
    tracking, the harness, the gate) reach the engine through its doors, so a change behind
    a door is not a change to what the stage imports. (A content hash is finetune.hashing's,
    the fingerprint's and the tracking's both; a model folder's check is engine.preflight's.)"""
    assert "engine.evaluate" in _engine_reached("tasks.evaluate")
    assert _side_entrances("tasks.evaluate") == {}


def test_the_validate_stage_reaches_the_engine_through_doors_only():
    """`finetune validate` (tasks.checks) asks engine.preflight for the model, resume and
    machine checks, and runs the other stages' own checks (the data sources through the data
    stages' modules, each export format's through the exporters): those reach the engine
    through their stages' doors (engine.prepare, engine.export), transitively."""
    reached = _engine_reached("tasks.checks")
    assert {"engine.preflight", "engine.prepare", "engine.export"} <= set(reached)
    assert _side_entrances("tasks.checks") == {}


def test_the_transitive_door_check_sees_a_side_entrance():
    """The checks above find a room reached only through another tasks module, as validate
    once reached engine.modeling.quantization through the exporters."""
    graph = {"tasks.checks": {"tasks.exporters", "engine.preflight"},
             "tasks.exporters": {"tasks.exporters.quantized"},
             "tasks.exporters.quantized": {"engine.modeling.quantization", "finetune.errors"}}
    assert _side_entrances("tasks.checks", graph) == {"engine.modeling.quantization": [
        "tasks.checks", "tasks.exporters", "tasks.exporters.quantized"]}


def test_no_stage_imports_a_method_room():
    """No module in tasks/ imports engine.recipe.* (lazy imports too): what a stage needs of
    a method comes through a door (engine.evaluate asks the run class) or from a room that
    names no method (a reward model's check: engine.rollout), so a new method is not an edit
    to the stages and no stage depends on one method's room."""
    found = sorted((mod, dep) for mod, deps in _imports().items() if mod.startswith("tasks")
                   for dep in deps if dep == "engine.recipe" or dep.startswith("engine.recipe."))
    assert found == []


def _method_flag_reads(source: str) -> list[str]:
    """Reads of the method flags the stages once branched on: `.paired`, `.classifier`."""
    return sorted(f"{node.attr} (line {node.lineno})" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr in ("paired", "classifier"))


def test_no_stage_branches_on_a_method_flag():
    """No stage reads `paired` or `classifier`: a dataset type declares its targets and a
    trainer type the rows it accepts (finetune.config.methods), and the method's room does the
    rest, so a new method is a room and a registry line, not an edit to the stages."""
    found = {_module(p): hits for p in (ROOT / "tasks").rglob("*.py")
             if (hits := _method_flag_reads(p.read_text()))}
    assert found == {}
    assert _method_flag_reads("x = cfg.data.task.classifier\nif d.paired: pass\n") == [
        "classifier (line 1)", "paired (line 2)"]


def _method_names_in(source: str, names: set[str]) -> list[str]:
    """Where `source` names a method: a string (docstrings aside) that is one of `names`, or a
    read of an attribute so named (a method's own section: `c.grpo`)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    hits = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value in names and id(node) not in docstrings):
            hits.append(f"'{node.value}' (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            hits.append(f".{node.attr} (line {node.lineno})")
    return sorted(hits)


def test_the_compatibility_table_names_no_method():
    """finetune/config/compat.py is every method's table, so it names none of them, nor their
    own sections: a method's rows are declared beside its section (`add_rows`), what differs
    by method is asked of its facts (finetune.config.methods.Method: `stderr`, `task`,
    `refusal`), so a new method is not an edit to the table."""
    from finetune.config.methods import method_names, method_of

    names = {n for name in method_names() for n in (name, *method_of(name).own_sections)}
    assert {"sft", "dpo", "grpo"} <= names
    source = (ROOT / "finetune/config/compat.py").read_text()
    assert _method_names_in(source, names) == []
    assert _method_names_in('"""dpo"""\nx = {"training.type": "dpo"}\nif c.grpo.beta: pass\n',
                            names) == ["'dpo' (line 2)", ".grpo (line 3)"]


#: the model kind's flags: the config's (ModelTask.classifier, .encoder_decoder) and the
#: loaded model's (transformers' is_encoder_decoder, as an attribute or a getattr name)
KIND_FLAGS = ("classifier", "encoder_decoder", "is_encoder_decoder")
#: where a kind flag may be read: the kinds themselves, and the loader's guard against an
#: encoder-decoder reached by a class named by path (engine.modeling.model, which the kinds'
#: architecture check calls)
KIND_FLAG_READERS = ("engine.kinds", "engine.modeling.model")


def _kind_flag_reads(source: str) -> list[str]:
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in KIND_FLAGS:
            hits.append(f"{node.attr} (line {node.lineno})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in KIND_FLAGS):
            hits.append(f"{node.args[1].value} (line {node.lineno})")
    return sorted(hits)


def test_no_module_outside_the_kinds_reads_a_kind_flag():
    """The engine and the stages ask the model kind (engine.kinds) what differs by the family
    of model trained, never a flag: a new family (vision-language) is a kind module and a
    registry line, not branches through the rooms. The config (finetune/) keeps its own facts
    for the compatibility rows, which run before any engine code."""
    found = {module: hits for pkg in ("engine", "tasks", "flows")
             for p in (ROOT / pkg).rglob("*.py")
             if not (module := _module(p)).startswith(KIND_FLAG_READERS)
             and (hits := _kind_flag_reads(p.read_text()))}
    assert found == {}
    assert _kind_flag_reads("a = cfg.model_task.encoder_decoder\n"
                            "b = getattr(config, 'is_encoder_decoder', False)\n") == [
        "encoder_decoder (line 1)", "is_encoder_decoder (line 2)"]


def _run_members_read(module: str) -> set[str]:
    """Every `run.X` a module reads or calls."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "run"}


def test_the_run_surface_is_declared_and_provided():
    """trainer_state reads only what engine.state.run_view.RunView declares, and TrainingRun
    provides every declared member (set in its methods, or defined on the class)."""
    from engine.recipe.run import TrainingRun
    from engine.state.run_view import RunView

    declared = {n for n in vars(RunView) if not n.startswith("_")} | set(
        RunView.__annotations__)
    read = _run_members_read("engine.state.trainer_state")
    assert len(read) > 10 and read - declared == set()
    assigned = {node.attr for node in ast.walk(ast.parse((ROOT / "engine/recipe/run.py").read_text()))
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"}
    provided = assigned | {n for n in dir(TrainingRun) if not n.startswith("_")}
    assert declared - provided == set()


def _string_references() -> list[tuple[str, str]]:
    """(module, reference) for each project module named in a string: `pkg.module:name`
    references (stage functions, the stream source handed to the worker) and `-m pkg.module`
    arguments of a command line."""
    import re

    pattern = re.compile(rf"({'|'.join(FLOORS)})(\.\w+)+(:\w+(\.\w+)*)?")
    found = []
    for pkg in FLOORS:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                        ":" in node.value and pattern.fullmatch(node.value)):
                    found.append((_module(path), node.value))
                if isinstance(node, (ast.List, ast.Tuple)):
                    items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                    found += [(_module(path), module) for flag, module in zip(items, items[1:])
                              if flag == "-m" and isinstance(module, str)
                              and pattern.fullmatch(module)]
    return found


def test_string_module_references_resolve_and_go_one_way():
    """A module named in a string is imported at run time all the same: it must exist (a
    moved module breaks no string silently) and sit on the same floor or below."""
    import importlib

    refs = _string_references()
    assert {"tasks.train:train", "engine.worker"} <= {r for _, r in refs}
    for module, ref in refs:
        target, _, name = ref.partition(":")
        obj = importlib.import_module(target)
        for part in filter(None, name.split(".")):
            obj = getattr(obj, part)
        assert FLOORS[target.split(".")[0]] <= FLOORS[module.split(".")[0]], (module, ref)


#: the strategies' own config sections, and the property that reads one of them
STRATEGY_SECTIONS = {"fsdp", "diloco", "pipeline", "shards_with_fsdp"}


def _section_reads(source: str, me: str) -> list[tuple[str, str]]:
    """(module `me`, name) for each read of a strategy's config section in `source`:
    `x.fsdp`/`.diloco`/`.pipeline`/`.shards_with_fsdp` on anything, the bare name
    shards_with_fsdp, and getattr/hasattr with one of them as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_SECTIONS:
            found.append((me, node.attr))
        elif isinstance(node, ast.Name) and node.id == "shards_with_fsdp":
            found.append((me, node.id))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in STRATEGY_SECTIONS):
            found.append((me, node.args[1].value))
    return found


def test_no_distributed_section_reads_outside_the_strategies():
    """Model setup, checkpoints, the loop and preflight ask a strategy (or a function in
    engine/strategies/) what its section decides; only engine/strategies/ reads
    `distributed.fsdp`, `.diloco`, `.pipeline` or `shards_with_fsdp`."""
    found = sorted(hit for path in (ROOT / "engine").rglob("*.py")
                   if "strategies" not in path.relative_to(ROOT / "engine").parts
                   for hit in _section_reads(path.read_text(), _module(path)))
    assert found == []


def test_the_section_read_check_sees_a_read():
    """The check above is not vacuous: it flags every form of reading a section, and not an
    import of torch.distributed.fsdp nor a message that names a section."""
    source = ("from torch.distributed.fsdp import fully_shard\n"
              "c = cfg.distributed.fsdp.cpu_offload\n"
              "if d.shards_with_fsdp or shards_with_fsdp: pass\n"
              "s = getattr(cfg.distributed, 'pipeline')\n"
              "h = dist.diloco is None\n"
              "raise ValueError('distributed.pipeline: 3 stages')\n")
    assert sorted(_section_reads(source, "engine.recipe.x")) == sorted([
        ("engine.recipe.x", "fsdp"), ("engine.recipe.x", "shards_with_fsdp"),
        ("engine.recipe.x", "shards_with_fsdp"), ("engine.recipe.x", "pipeline"),
        ("engine.recipe.x", "diloco")])
