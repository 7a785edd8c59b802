"""The import graph of the trainer package: no circle, and no import running back up its floors.

    python tools/imports.py [--root .] [--package trainer] [--quiet]

prints each module's floor and the modules it imports, then every problem on a line of its own,
and exits 1 if there is one (`make lint` runs it), else 0.

What counts as an import: every `import` and `from ... import` that runs, at module level or inside
a function. A function-level import is still a dependency: it only defers the import until the call
(to keep torch out of the config's path, or to dodge a circle at import time), and a circle through
one is a circle in the design: each module needs the other to be understood or changed, and the
deferred import can still fail half-way through a call. Imports under `if TYPE_CHECKING:` are not
counted: they never run and only name types for annotations (every module has `from __future__
import annotations`). `from trainer.models import ModelArgs` is an import of trainer.models;
`from trainer import hf` of trainer.hf (a submodule named in the list is the module imported).

The floors are declared below, bottom first: a module may import modules of its own floor or below,
never above. They are declared, not derived from the graph, because a derived floor follows every
import (an import running up would just lift the importer), and the point is to say which way the
layers go: the config's sections and their checks torch-free at the bottom, the run at the top.
Within a floor only the circle check applies. A module of the package that no floor names is a
problem too: a new module is placed where it belongs, on purpose.

Standard library only, so that it runs before the venv exists (any python3 of 3.9 or later).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

# Bottom first: the folders of trainer/ are the floors (trainer/rundir/ is one floor, trainer/launchers/
# another), and the few modules at the top of trainer/ stand on the floor of what they are. A name
# ending in ".*" places a package's __init__ and every module under it.
FLOORS: list[tuple[str, list[str]]] = [
    # The standard-library helpers every module may use.
    ("base", ["trainer", "trainer.ranges", "trainer.torch_compat", "trainer.version"]),
    # The run dir's files: the one safe way to open and hold them, their names, the lease. The host
    # modules (Python 3.6, no venv) are here and in launchers/requeue.
    ("run dir", ["trainer.rundir.*"]),
    # What keeps a run alive or ends it clearly: signals, outcomes, hangs, heartbeats, health checks.
    ("resilience", ["trainer.resilience.*"]),
    # The one table of commands and the parser each builds (its errors exit as outcomes.BAD_INPUT).
    ("command table", ["trainer.cli"]),
    # What the config's sections are defined beside and what reads the files a config names: the model
    # families (the Hugging Face folders with them), the optimizer, the token files, early stopping.
    # They import no config.
    ("sections", ["trainer.models.*", "trainer.hf", "trainer.optim", "trainer.prepare", "trainer.early_stop"]),
    ("config", ["trainer.config"]),
    # The parts of a run, each configured by its section.
    (
        "parts",
        ["trainer.dist", "trainer.data", "trainer.parallel.*", "trainer.checkpoint.*", "trainer.observe.*"],
    ),
    # Before anything runs: the checks of a config against the machine, memory and interval planning.
    ("preflight", ["trainer.preflight.*"]),
    ("run", ["trainer.train"]),
    # What runs on a run dir's checkpoints.
    ("commands", ["trainer.commands.*"]),
    # How a run is started: the launchers, the ranks' entry point, the Python API, and the
    # `python -m trainer.X` names users type for commands that live in a folder.
    (
        "front doors",
        [
            "trainer.launchers.*",
            "trainer.__main__",
            "trainer.api",
            "trainer.launch",
            "trainer.submit",
            "trainer.requeue",
            "trainer.check",
            "trainer.export",
            "trainer.generate",
            "trainer.evaluate",
            "trainer.metrics",
        ],
    ),
]

# Circles that another change owns and breaks: reported, not failed on. Each entry is the sorted
# set of modules of the circle, and why it is allowed for now. Keep it empty.
KNOWN_CIRCLES: dict[frozenset, str] = {}


def module_files(root: str, package: str) -> dict[str, str]:
    """{dotted module name: path} of every .py file of `package` under `root`."""
    found = {}
    base = os.path.join(root, *package.split("."))
    for folder, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(folder, root).split(os.sep)
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            parts = rel + ([] if name == "__init__.py" else [name[:-3]])
            found[".".join(parts)] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """(node, level, module, names) of every import that runs: TYPE_CHECKING blocks skipped."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, 0, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield node, node.level, node.module or "", [a.name for a in node.names]
        stack.extend(ast.iter_child_nodes(node))


def graph(root: str, package: str) -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: line of its first import}}."""
    modules = module_files(root, package)
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith("__init__.py")
        here = name.split(".") if is_package else name.split(".")[:-1]
        out: dict[str, int] = {}
        for node, level, module, names in _imports(tree):
            if level:  # relative: from the importing module's package, `level - 1` folders up
                base = here[: len(here) - (level - 1)]
                module = ".".join(base + ([module] if module else []))
            targets = []
            for alias in names:  # `from trainer import hf`: the submodule
                sub = f"{module}.{alias}" if module else alias
                if sub in modules:
                    targets.append(sub)
            if not targets or len(targets) < len(names):
                targets.append(module)
            for target in targets:
                while target and target not in modules and "." in target:  # a name inside a module
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    out[target] = min(out.get(target, node.lineno), node.lineno)
        edges[name] = out
    return edges


def floor_of(module: str) -> int | None:
    """The index in FLOORS of `module`'s floor, or None where none names it."""
    for i, (_, names) in enumerate(FLOORS):
        for entry in names:
            if module == entry or (entry.endswith(".*") and (module + ".").startswith(entry[:-1])):
                return i
            if entry.endswith(".*") and module == entry[:-2]:
                return i
    return None


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth: the package's module count
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _cycle_path(component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One circle through the component's first module, as a path that ends where it starts."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v]):
            if w == start:
                return paths[v] + [start]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def problems(edges: dict[str, dict[str, int]], root: str, package: str) -> tuple[list[str], list[str]]:
    """(problems, notes): the lines that fail the check, and the known circles reported."""
    out, notes = [], []
    files = module_files(root, package)
    for module in sorted(edges):
        if floor_of(module) is None:
            out.append(
                f"{files[module]}: {module} is on no floor; add it to FLOORS in tools/imports.py "
                f"(the lowest floor whose modules are all it imports)"
            )
    for module in sorted(edges):
        mine = floor_of(module)
        for target, line in sorted(edges[module].items()):
            theirs = floor_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                out.append(
                    f"{files[module]}:{line}: {module} (floor {FLOORS[mine][0]!r}) imports {target}, "
                    f"a floor above it ({FLOORS[theirs][0]!r}); move what it needs down, or the importer up"
                )
    found = circles(edges)
    for component in found:
        cycle = _cycle_path(component, edges)
        path = " -> ".join(f"{a} ({files[a]}:{edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
        what = f"import circle of {len(component)} modules ({', '.join(component)}), e.g. {path}"
        why = KNOWN_CIRCLES.get(frozenset(component))
        if why:
            notes.append(f"known {what}: {why}")
        else:
            out.append(f"{what}; break it by moving what one side needs below both")
    for known in set(KNOWN_CIRCLES) - {frozenset(c) for c in found}:
        if not known <= set(edges):
            continue  # not all of its modules here: another package (the tests' planted ones)
        out.append(f"the known circle of {', '.join(sorted(known))} is gone: remove it from KNOWN_CIRCLES")
    return out, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the folder holding the package")
    parser.add_argument("--package", default="trainer")
    parser.add_argument("--quiet", action="store_true", help="print the problems only")
    args = parser.parse_args(argv)
    edges = graph(args.root, args.package)
    if not args.quiet:
        for i, (floor, _) in enumerate(FLOORS):
            names = [m for m in sorted(edges) if floor_of(m) == i]
            print(f"floor {i} {floor}:")
            for m in names:
                print(f"  {m} -> {', '.join(sorted(edges[m])) or '(nothing of the package)'}")
    found, notes = problems(edges, args.root, args.package)
    for line in notes:
        print(f"imports: {line}")
    for line in found:
        print(f"imports: {line}", file=sys.stderr)
    if found:
        print(f"imports: {len(found)} problem(s) in the import graph of {args.package}/", file=sys.stderr)
        return 1
    print(f"imports: {len(edges)} modules of {args.package}/, no circle, none imports a floor above it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
