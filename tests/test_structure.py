"""The layout's rules, checked: no import circle between boostlr's modules, and no module
so long that it does more than one job (the step loop reads in one sitting)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "boostlr"
MAX_LINES = 500
LOOP_MAX_LINES = 200


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """boostlr modules ``path`` imports, at any depth (a function-level import too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import sub`` imports the submodule when there is one.
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("boostlr"):
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: imports_of(path, known) - {name} for name, path in known.items()}
    # A module inside a package imports that package's __init__ first: not a dependency of
    # the package on it, so edges from a package to its own submodules stay as written.
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle() -> None:
    graph = import_graph()
    assert "boostlr.train.loop" in graph and graph["boostlr.train.loop"]  # the graph is real
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_module_over_500_lines_and_a_short_step_loop() -> None:
    long = {
        name: n
        for name, p in modules().items()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
    loop = len((PACKAGE / "train" / "loop.py").read_text().splitlines())
    assert loop <= LOOP_MAX_LINES, loop


def test_the_cost_model_imports_nothing_from_the_engine() -> None:
    """``analysis/`` plans from shapes (``boostlr.models``) and the config alone: a change to
    the parallel engine cannot break planning, and planning never needs the engine."""
    graph = import_graph()
    analysis = {name for name in graph if name.startswith("boostlr.analysis")}
    assert "boostlr.analysis.costmodel" in analysis
    reached, todo = set(), list(analysis)
    while todo:  # everything the cost model imports, at any remove
        for dep in graph.get(todo.pop(), ()):
            if dep not in reached:
                reached.add(dep)
                todo.append(dep)
    engine = sorted(dep for dep in reached if dep.startswith("boostlr.parallel"))
    assert not engine, engine


# ----------------------------------------------------------------------------- device specifics

PLATFORM = "boostlr.platform"
# What the platform may stand on: nothing of boostlr's above the ground floor.
PLATFORM_DEPS = {"boostlr.errors", "boostlr._torch_internals", "boostlr.models.philox"}
BACKENDS = {"nccl", "gloo", "mpi", "ucc"}
DEVICE_WORDS = {"cpu", "cuda", "mps", "xpu", "hpu", "meta", *BACKENDS}
# Modules still allowed to branch on a device, each with why. Every entry must still need
# it (the test fails on a stale one), so the list only shrinks.
DEVICE_ALLOWED = {
    # A hardware profile's "device" field ("gpu"/"cpu": what calibrate measured), not a
    # torch device or backend.
    "boostlr.analysis.hardware": "profile kind",
    # ``torch.device(device).type == "meta"``: building without storage, not a device kind.
    "boostlr.models.llama": "meta build",
}


def _words(node: ast.AST, words: set[str] = DEVICE_WORDS) -> set[str]:
    """Device/backend names written as string constants in ``node`` (tuples included)."""
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in words
    }


def device_branches(source: str) -> list[str]:
    """Where ``source`` decides by device kind or backend name itself (line: what)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{where}: torch.cuda")
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            found.append(f"{where}: .is_cuda")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            by_type = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
            if by_type or any(_words(s) for s in sides):
                found.append(f"{where}: compares {ast.unparse(node)}")
        elif isinstance(node, ast.IfExp) and _words(node, BACKENDS):
            found.append(f"{where}: chooses {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]))


def test_the_device_rule_finds_the_branches_it_forbids() -> None:
    code = (
        'a = device.type == "cuda"\n'
        'b = "nccl" if x else "gloo"\n'
        "c = torch.cuda.synchronize\n"
        'd = dist.get_backend(g) in ("gloo", "mpi")\n'
        "e = t.is_cuda\n"
        'f = torch.autocast(device.type, dtype=x)\nrng = {"cpu": 1}\n'
    )
    assert [line.split(":")[0] for line in device_branches(code)] == [
        f"line {i}" for i in (1, 2, 3, 4, 5)
    ]


def in_platform(name: str) -> bool:
    return name == PLATFORM or name.startswith(PLATFORM + ".")


def test_only_the_platform_branches_on_device_or_backend() -> None:
    """The ``boostlr.platform`` package is the one home of device specifics: backend,
    rank->GPU mapping, timing, syncs, memory, copies, generators. Passing ``device.type`` on
    (to autocast) is fine; deciding by it is not."""
    found, stale, platform_branches = {}, [], {}
    for name, path in modules().items():
        branches = device_branches(path.read_text())
        if in_platform(name):
            platform_branches[name] = branches
        elif name in DEVICE_ALLOWED:
            if not branches:
                stale.append(name)
        elif branches:
            found[name] = branches
    assert not found, found
    assert not stale, f"no longer branch on a device: drop from DEVICE_ALLOWED: {stale}"
    # The rule sees the package that does branch (CUDA's calls live in its platform).
    assert platform_branches.get(f"{PLATFORM}.cuda"), platform_branches


def test_the_platform_is_on_the_ground_floor() -> None:
    """Data, checkpoints, the engine and the trainer import the platform, so it imports none
    of them (nor anything above it), and no device module is left under ``parallel/``."""
    graph = import_graph()
    platform = {name for name in graph if in_platform(name)}
    assert {PLATFORM, f"{PLATFORM}.host", f"{PLATFORM}.cuda"} <= platform
    above = {name: sorted(graph[name] - platform - PLATFORM_DEPS) for name in platform}
    assert not {name: deps for name, deps in above.items() if deps}
    assert "boostlr.parallel.device" not in graph
    users = {"boostlr.data.loader", "boostlr.rundir.writer", "boostlr.rundir.payload"}
    assert all(graph[name] & platform for name in users)


def test_the_command_line_is_imported_by_nothing_but_itself() -> None:
    """``boostlr.cli`` is the top floor: the library never reaches up into it, and each
    command module reaches the others only through ``cli.common`` (none imports a sibling
    command or the package that assembles them)."""
    graph = import_graph()
    cli = {name for name in graph if name == "boostlr.cli" or name.startswith("boostlr.cli.")}
    assert {"boostlr.cli", "boostlr.cli.common", "boostlr.cli.train"} <= cli
    up = {name: sorted(deps & cli) for name, deps in graph.items() if name not in cli}
    assert not {name: deps for name, deps in up.items() if deps}
    commands = cli - {"boostlr.cli", "boostlr.cli.common", "boostlr.cli.__main__"}
    sideways = {name: sorted(graph[name] & (cli - {"boostlr.cli.common"})) for name in commands}
    assert not {name: deps for name, deps in sideways.items() if deps}


def test_the_run_directory_readers_import_nothing_from_the_trainer() -> None:
    """``export``, ``eval`` and ``ckpt info`` read run directories through ``boostlr.rundir``
    (the format's one home): a change to the trainer cannot break them, at any remove."""
    graph = import_graph()
    readers = {"boostlr.export", "boostlr.evaluate"}
    readers |= {name for name in graph if name.startswith("boostlr.rundir")}
    assert {"boostlr.rundir.checkpoint", "boostlr.rundir.info"} <= readers
    for reader in sorted(readers):
        reached, todo = set(), [reader]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        trainer = sorted(
            d for d in reached if d == "boostlr.train" or d.startswith("boostlr.train.")
        )
        assert not trainer, f"{reader} imports {trainer}"


# Modules allowed to name private torch symbols: the one home, and the trace package's fake
# world, which declares its own (it traces, it does not train).
PRIVATE_TORCH_HOMES = {"boostlr._torch_internals", "boostlr.trace.fake_world"}


def private_torch_uses(source: str) -> list[str]:
    """Private torch names a module's source reaches: ``torch._C...``, ``from
    torch.x._y import ...``, ``from torch.x import _y``, or ``<torch module>._attr``."""
    tree = ast.parse(source)
    torch_names = {"torch"}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "torch"
        ):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts):
                found.append(node.module)
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                torch_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if any(p.startswith("_") for p in alias.name.split(".")):
                        found.append(alias.name)
                    torch_names.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"{ast.unparse(node)}")
    return found


def test_the_private_torch_rule_finds_what_it_forbids() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed.pipelining import schedules as s\n"
        "from torch.distributed.fsdp._fully_shard import x\n"
        "a = torch._C._current_graph_task_id()\nb = dist.ProcessGroupGloo._Options()\n"
        "c = s._wait_batch_p2p\nd = torch.float32\ne = self._private\n"
    )
    found = private_torch_uses(source)
    assert "torch.distributed.fsdp._fully_shard" in found
    assert any("_current_graph_task_id" in f for f in found)
    assert any("_Options" in f for f in found)
    assert any("_wait_batch_p2p" in f for f in found)
    assert not any("float32" in f or "_private" in f for f in found)


def test_private_torch_symbols_only_in_torch_internals() -> None:
    offenders = {
        name: uses
        for name, path in modules().items()
        if name not in PRIVATE_TORCH_HOMES and (uses := private_torch_uses(path.read_text()))
    }
    assert not offenders, offenders


# ----------------------------------------------------------------------------- strategy, arch names

STRATEGY_NAMES = {"megatron", "vanilla", "btp"}
ARCH_NAMES = {"full", "cola", "svd", "lax"}
# A name compared with one of these means something else: LaX's gate kind ("full"), the
# pipeline's backward type ("full").
OTHER_MEANINGS = ("gate", "backward_type")
# The one home of each kind's facts (boostlr.specs), the schema's Literal sets, and the
# standalone remote-code model (it cannot import boostlr).
NAME_HOMES = {
    "strategy": {"boostlr.specs.strategy", "boostlr.config.schema"},
    "arch": {"boostlr.specs.arch", "boostlr.config.schema", "boostlr.hf.modeling_boostlr"},
}


def _named(node: ast.AST) -> set[str]:
    """Strategy or arch names written as string constants in ``node`` (tuples included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        values = {node.value}
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
    else:
        return set()
    return values & (STRATEGY_NAMES | ARCH_NAMES)


def _other_meaning(subject: ast.AST) -> bool:
    words = set()
    for n in ast.walk(subject):
        if isinstance(n, ast.Name):
            words.add(n.id)
        elif isinstance(n, ast.Attribute):
            words.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            words.add(n.value)
    return any(other in word for word in words for other in OTHER_MEANINGS)


def name_comparisons(source: str) -> dict[str, list[str]]:
    """Where ``source`` compares something with a strategy or arch name (``==``, ``!=``,
    ``in``, ``not in``, a ``match`` case), per kind: ``{"strategy": [...], "arch": [...]}``."""
    found: dict[str, list[str]] = {"strategy": [], "arch": []}

    def note(names: set[str], subjects: list[ast.AST], node: ast.AST, text: str) -> None:
        if not names or any(_other_meaning(s) for s in subjects):
            return
        where = f"line {node.lineno}: {text}"
        if names & STRATEGY_NAMES:
            found["strategy"].append(where)
        if names & ARCH_NAMES:
            found["arch"].append(where)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = set().union(*(_named(s) for s in sides))
            note(names, [s for s in sides if not _named(s)], node, ast.unparse(node))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                values = [p for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                names = set().union(*(_named(p.value) for p in values))
                note(names, [node.subject], case.pattern, f"match {ast.unparse(node.subject)}")
    for hits in found.values():
        hits.sort(key=lambda hit: int(hit.split(":")[0].split()[1]))
    return found


def test_the_name_rule_finds_the_comparisons_it_forbids() -> None:
    code = (
        'a = cfg.arch == "lax"\n'
        'b = strategy in ("btp", "vanilla")\n'
        'c = line["strategy"] != "megatron"\n'
        "match p.tp_strategy:\n"
        '    case "btp" | "auto":\n'
        "        pass\n"
        'e = "svd" == s\n'
        'f = cfg.lax_gate == "full"\n'
        'g = backward_type != "full"\n'
        'h = {"btp": 1}[name]\n'
        'i = m.arch == "auto"\n'
    )
    found = name_comparisons(code)
    assert [w.split(":")[0] for w in found["strategy"]] == ["line 2", "line 3", "line 5"]
    assert [w.split(":")[0] for w in found["arch"]] == ["line 1", "line 7"]


def test_strategy_and_arch_names_are_compared_only_in_their_homes() -> None:
    """What a strategy or an arch *is* lives in its spec (``boostlr.specs``): everything else
    reads the spec's facts (``residual_sharded``, ``crossing``, ...) instead of comparing
    names, so a new strategy or arch is its own module plus its spec entry."""
    found: dict[str, list[str]] = {}
    for name, path in modules().items():
        for kind, hits in name_comparisons(path.read_text()).items():
            if hits and name not in NAME_HOMES[kind]:
                found.setdefault(name, []).extend(f"{kind} {hit}" for hit in hits)
    assert not found, found


# ----------------------------------------------------------------------------- schedule names

SCHEDULE_NAMES = {"gpipe", "1f1b", "interleaved"}
# The schedules' facts (boostlr.specs.schedule) and the schema's Literal set (and its
# stages-per-rank property).
SCHEDULE_HOMES = {"boostlr.specs.schedule", "boostlr.config.schema"}


def _strings(node: ast.AST | None) -> set[str]:
    """String constants written in ``node`` (tuples, lists and sets included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def schedule_comparisons(source: str) -> list[str]:
    """Where ``source`` tells pipeline schedules apart by name: compares something with one
    (``==``, ``!=``, ``in``, ``not in``, a ``match`` case) or keys a table by them."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if set().union(*(_strings(s) for s in sides)) & SCHEDULE_NAMES:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                values = [p for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                if set().union(*(_strings(v.value) for v in values)) & SCHEDULE_NAMES:
                    found.append((case.pattern.lineno, f"match {ast.unparse(node.subject)}"))
        elif isinstance(node, ast.Dict):
            if set().union(*(_strings(k) for k in node.keys)) & SCHEDULE_NAMES:
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {text}" for line, text in sorted(found)]


def test_the_schedule_rule_finds_what_it_forbids() -> None:
    code = (
        'a = p.pp_schedule == "interleaved"\n'
        'b = schedule in ("1f1b", "interleaved")\n'
        "match p.pp_schedule:\n"
        '    case "gpipe":\n'
        "        pass\n"
        'd = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}\n'
        'e = spec.timing == "virtual-slots"\n'
        "f = p.pp_schedule == spec.name\n"
        'g = "1f1b" != s\n'
    )
    assert [hit.split(":")[0] for hit in schedule_comparisons(code)] == [
        "line 1",
        "line 2",
        "line 4",
        "line 6",
        "line 9",
    ]


def test_schedule_names_are_compared_only_in_their_homes() -> None:
    """What a pipeline schedule *is* lives in its spec (``boostlr.specs.schedule``): the
    pipeline, validation, the memory model and the cost model read its facts (the torch
    class, stages per rank, micro-batch constraints, micro-batches in flight, timing), so a
    new schedule is its spec entry (plus a program, to be simulated)."""
    found = {
        name: hits
        for name, path in modules().items()
        if name not in SCHEDULE_HOMES and (hits := schedule_comparisons(path.read_text()))
    }
    assert not found, found


# ----------------------------------------------------------------------------- MoE names

#: The MoE dispatch forms' and balances' names (``model.moe_dispatch``, ``model.moe_balance``).
MOE_NAMES = {"latent", "hidden", "bias", "aux"}
# Their one home (boostlr.specs.moe), the schema's Literal sets and defaults, and the
# standalone remote-code files an export carries (they cannot import boostlr).
MOE_NAME_HOMES = {
    "boostlr.specs.moe",
    "boostlr.config.schema",
    "boostlr.hf.configuration_boostlr",
    "boostlr.hf.modeling_boostlr_moe",
}


def moe_name_literals(source: str) -> list[str]:
    """Where ``source`` writes an MoE dispatch or balance name as a string constant: compared,
    keyed, passed or returned, each is a decision that belongs to the spec's facts."""
    return [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and node.value in MOE_NAMES
    ]


def test_the_moe_name_rule_finds_what_it_forbids() -> None:
    code = (
        'a = moe_dispatch_of(m) == "latent"\n'
        'b = m.moe_balance in ("bias", "aux")\n'
        'c = f"dispatch {LATENT.name}"\n'
        'out = [(FULL.name, "hidden")]\n'
        'e = "the latent form"\n'
        "f = spec.shared_outer\n"
    )
    assert [hit.split(":")[0] for hit in moe_name_literals(code)] == [
        "line 1",
        "line 2",
        "line 2",
        "line 4",
    ]


def test_moe_names_are_written_only_in_their_homes() -> None:
    """What a dispatch form or a balance *is* (what a copy carries, the router's scores, a
    selection bias, a balance loss) lives in :mod:`boostlr.specs.moe`: the runtime,
    validation, the cost model, the trace and the export read its facts, so a new form or
    balance is its spec entry plus its runtime (docs/extending.md)."""
    found = {
        name: hits
        for name, path in modules().items()
        if name not in MOE_NAME_HOMES and (hits := moe_name_literals(path.read_text()))
    }
    assert not found, found
    assert moe_name_literals((PACKAGE / "specs" / "moe.py").read_text())  # the rule sees it


def test_the_step_loop_knows_no_moe() -> None:
    """The step loop runs whatever model the engine built: an MoE model's bookkeeping (the
    balance bias after the optimizer step, the balance loss's scale, the routing metrics)
    reaches it through the engine's generic step hooks (``parallel/step_hooks.py``)."""
    graph = import_graph()
    moe = {n for n in graph if "moe" in n.rpartition(".")[2] or n.endswith(".expert_parallel")}
    loop = "boostlr.train.loop"
    assert not graph[loop] & moe, sorted(graph[loop] & moe)
    assert {"boostlr.models.moe", "boostlr.specs.moe", "boostlr.models.moe_router"} <= moe
    source = ast.parse((PACKAGE / "train" / "loop.py").read_text())
    words = {n.id for n in ast.walk(source) if isinstance(n, ast.Name)}
    words |= {n.attr for n in ast.walk(source) if isinstance(n, ast.Attribute)}
    assert not {w for w in words if "moe" in w.lower()}, words
