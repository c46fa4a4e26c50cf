"""The package's layers (CONTRIBUTING.md's code map): each part imports only the parts above it and the shared
modules; no module of the package imports itself round a loop of imports; a long module says why it is one file."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "lightning_fl"
SHARED = {"errors", "checkpoint", "seeding", "runs", "context", "steps", "metrics", "threads", "quiet", "trainer_api"}
# Top to bottom as in CONTRIBUTING.md's code map; a part may import the parts before it.
LAYERS = [
    {"data"},
    {"models", "mapping", "compress", "privacy"},
    {"methods"},
    {"federated"},
    {"oneshot"},
    {"cli", "__main__"},
    {"flower"},
]


def part_of(path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imported_parts(path) -> set[str]:
    """The top-level parts of ``lightning_fl`` that ``path`` imports (anywhere in the file, lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = node.module.split(".")
            if names[0] == "lightning_fl":
                found.add(names[1] if len(names) > 1 else "")
                if len(names) == 1:  # from lightning_fl import data, methods, ...
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "lightning_fl":
                    found.add(names[1] if len(names) > 1 else "")
    return found


def test_every_part_imports_only_the_parts_above_it():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    new = "a new part of the package: place it in LAYERS and CONTRIBUTING.md's code map"
    assert parts - SHARED - set(rank) == set(), new
    back_edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = part_of(path)
        if mine == "__init__":
            continue
        for other in imported_parts(path) - {mine, ""}:
            if mine in SHARED and other not in SHARED:
                back_edges.append(f"{path.relative_to(REPO)} (shared) imports {other}")
            elif mine in rank and other in rank and rank[other] > rank[mine]:
                back_edges.append(f"{path.relative_to(REPO)} ({mine}) imports {other}, a part below it")
    # The package's __init__ (lazy names, ``load_plugins``) reaches every part on purpose: it is the one exception.
    assert not back_edges, "\n".join(back_edges)


# A module longer than this says in its docstring why it is one file ("Kept as one file: <what splitting would
# lose>"), or is split along a line a reader would draw.
LONG = 300
REASON = "Kept as one file:"
LONG_WITHOUT_REASON: set[str] = set()  # (none: every long module says why)


def test_every_long_module_says_why_it_is_one_file():
    unexplained = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if (lines := len(text.splitlines())) <= LONG:
            continue
        reason = (ast.get_docstring(ast.parse(text, str(path))) or "").partition(REASON)[2]
        if len(reason.split()) < 8:  # the phrase, then a sentence
            unexplained[path.relative_to(REPO).as_posix()] = lines
    missing = [f"{name} ({lines} lines)" for name, lines in unexplained.items() if name not in LONG_WITHOUT_REASON]
    fix = f"over {LONG} lines: split each along a line a reader would draw, or say in its docstring '{REASON} <why>'"
    assert not missing, "\n".join([fix, *missing])
    stale = sorted(LONG_WITHOUT_REASON - unexplained.keys())
    assert not stale, f"short now, or with their reason: remove them from LONG_WITHOUT_REASON: {stale}"


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``lightning_fl`` its import statements name (anywhere in the file, lazy imports
    too). ``from pkg import name`` names the module ``pkg.name`` where there is one, else ``pkg``: a package's
    ``__init__`` (and what it re-exports) is an edge only where a file imports a name from the package itself."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the file's package, up level - 1 packages
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                named.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {m for m in named if m in paths and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that import each
    other, directly or round a loop), each sorted, in sorted order."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        reach[start] = seen
    cycles = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph if m in reach[m]}
    return sorted(sorted(c) for c in cycles)


def test_the_import_graph_of_the_package_has_no_cycle():
    """No module imports itself round a loop of other modules, whether its imports are at the top of the file or
    inside functions (a lazy import hides a loop from Python, not from the design)."""
    graph = import_graph()
    assert {"lightning_fl.federated.clients.client", "lightning_fl.flower.transport"} <= set(graph)  # the graph is read
    assert "lightning_fl.steps" in graph["lightning_fl.federated.clients.client"]
    assert "lightning_fl.compress.wire" in graph["lightning_fl.flower.messages"]  # from ...compress import wire
    assert "lightning_fl.compress" not in graph["lightning_fl.flower.messages"]
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_names_each_loop_once():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
