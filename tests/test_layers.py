"""The package's layers (README's code map): each part imports only the parts above it and the shared modules; a
long module says why it is one file."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "lightning_fl"
SHARED = {"errors", "checkpoint", "seeding", "runs", "context", "steps", "metrics", "threads", "quiet", "trainer_api"}
# Top to bottom as in README's code map; a part may import the parts before it.
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
    assert parts - SHARED - set(rank) == set(), "a new part of the package: place it in LAYERS and README's code map"
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
# owned by the round / client-side refactor, to be removed when they land
LONG_WITHOUT_REASON = {
    "lightning_fl/federated/cohort.py",
    "lightning_fl/federated/dp_client.py",
    "lightning_fl/flower/secure.py",
}


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
