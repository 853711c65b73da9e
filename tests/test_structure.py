"""The package's shape, read from its source (nothing imported): no import circle between
its modules and no function longer than 70 lines."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mp_offload"
MAX_FUNCTION_LINES = 70


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known) -> set[str]:
    """The package's modules one import statement names (the most specific that exists:
    ``from .a import b`` is module ``a.b`` when there is one, else ``a``)."""
    if isinstance(node, ast.Import):
        bases = [(alias.name, []) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            anchor = parts if is_package else parts[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        bases = [(base, [alias.name for alias in node.names])]
    found = set()
    for base, names in bases:
        if not base.startswith(PACKAGE):
            continue
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
        found.update(subs or ([base] if base in known else []))
        if len(subs) < len(names) and base in known:
            found.add(base)  # names taken from the module itself
    return found


def import_graph() -> dict[str, set[str]]:
    """Every intra-package import, at the top, deferred in a function, or under
    TYPE_CHECKING alike: a circle that holds only through one is still a circle."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, is_package, modules)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_cycle_finder_sees_a_circle_through_a_deferred_import(tmp_path):
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert find_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []
    deferred = ast.parse("def f():\n    from .config import x\nif 0:\n    import mp_offload.b\n")
    nodes = [n for n in ast.walk(deferred) if isinstance(n, (ast.Import, ast.ImportFrom))]
    known = {"mp_offload.config", "mp_offload.b", "mp_offload.config_file"}
    found = set().union(*(_imported(n, "mp_offload.config_file", False, known) for n in nodes))
    assert found == {"mp_offload.config", "mp_offload.b"}


def test_no_import_circle_inside_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_planner_and_the_config_file_reach_only_what_they_need():
    """The planner plans from the model's config, not from checkpoint code; the --config
    file reader knows the schema only (no parser, no checks)."""
    graph = import_graph()
    planner = {m for m in graph if m.startswith("mp_offload.planner")}
    reach = {(m, d) for m in planner for d in graph[m] if d.startswith("mp_offload.checkpoint")}
    assert not reach, reach
    assert graph["mp_offload.config.file"] <= {
        "mp_offload.config.schema",
        "mp_offload.config.fields",
    }


def test_no_two_modules_share_a_base_name():
    """One name, one module: two modules named alike (``layout``, ``config``, ``overlap``)
    are read as each other in docs, tracebacks and reviews."""
    base = lambda path: os.path.splitext(os.path.basename(path))[0]  # noqa: E731
    names = sorted(base(p) for p in _modules().values())
    shared = {n for n in names if names.count(n) > 1} - {"__init__", "__main__"}
    assert not shared, f"modules of the package named alike: {sorted(shared)}"
    assert not os.path.exists(os.path.join(ROOT, PACKAGE, "dry_run.py"))


def test_the_package_top_holds_its_floors():
    """The runtime and the configuration are floors of their own, not loose top modules."""
    top = {n[:-3] for n in os.listdir(os.path.join(ROOT, PACKAGE)) if n.endswith(".py")}
    loose = top & {"distributed", "logger", "faults", "lifeline", "cpu_threads", "phase_timer"}
    loose |= top & {"config_schema", "config_file", "fields", "help_format", "dry_run"}
    assert not loose, f"modules that belong to runtime/, config/ or planner/: {sorted(loose)}"


def _defined_names(path: str) -> set[str]:
    """Names a module's top level binds (defs, classes, assignments, imports) and its
    lazy re-exports (the strings of its module-level tables, read by ``__getattr__``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(node.value, (ast.Dict, ast.List, ast.Tuple)):  # re-export tables
                strings = [n for n in ast.walk(node.value) if isinstance(n, ast.Constant)]
                names.update(n.value for n in strings if isinstance(n.value, str))
    return names


def _unresolved_imports() -> list[str]:
    """``from mp_offload.x import y`` statements, in the tests, tools, benchmarks and the
    package, whose ``y`` is neither a module nor a name ``x`` binds (read from the source:
    a stale file or cached bytecode of a moved module cannot hide one, as it can from
    an import)."""
    modules, bad = _modules(), []
    for top in ("tests", "tools", "bench", "scripts", PACKAGE):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in (n for n in files if n.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                        continue
                    if node.module.split(".")[0] != PACKAGE:
                        continue
                    where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                    if node.module not in modules:
                        bad.append(f"{where}: no module {node.module}")
                        continue
                    bound = _defined_names(modules[node.module])
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        ext = alias.name.startswith("_") and _is_extension(sub)
                        if sub not in modules and alias.name not in bound and not ext:
                            bad.append(f"{where}: {node.module} has no {alias.name}")
    return bad


def _is_extension(dotted: str) -> bool:
    """A compiled module of the package (built by set-up, not in the source tree)."""
    folder, name = os.path.split(os.path.join(ROOT, *dotted.split(".")))
    return name in ("_cpu_adam", "_host_ops") and os.path.isdir(folder)


def test_every_import_of_the_package_names_what_exists():
    """A module moved to a floor (``runtime/``, ``config/``) leaves no importer behind."""
    bad = _unresolved_imports()
    assert not bad, "imports of what does not exist:\n" + "\n".join(bad)


def _long_functions() -> list[str]:
    out = []
    for module, path in _modules().items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{module}.{node.name} ({n} lines)")
    return out


def test_no_function_over_70_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _short_subprocess_limits() -> list[str]:
    """Literal ``timeout=`` values under 120 s in the tests' calls (a subprocess's limit is
    a guard against a hang: tests/helpers.py HANG_TIMEOUT)."""
    out = []
    folder = os.path.join(ROOT, "tests")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            for kw in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
                value = kw.value
                if kw.arg == "timeout" and isinstance(value, ast.Constant):
                    if isinstance(value.value, (int, float)) and value.value < 120:
                        out.append(f"{name}:{node.lineno} timeout={value.value}")
    return out


def test_no_subprocess_limit_a_loaded_machine_would_reach():
    """A torch import alone takes minutes on a loaded 2-core machine."""
    short = _short_subprocess_limits()
    assert not short, short
