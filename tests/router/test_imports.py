"""Imports point one way: no cycle among the modules of `router/` (counting every import, those
under `TYPE_CHECKING` and inside functions too), and the packages' direction rule — `ownerserve`
(core) imports neither `planner` nor `router`, `planner` does not import `router`, `workers`
import neither (the composition root, `ownerserve/cli/`, is the one exception; `loadgen`
never imports `router` or `bench`). Read from the source with `ast`: nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _modules(package: str) -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The dotted names `path` (module `name`) imports, anywhere in it. `from a import b` is
    `a.b` when that is a module in `known` (a submodule), else `a`; a relative import is
    resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports."""
    modules = _modules(package)
    known = set(modules)
    return {
        name: {m for m in _imported(name, path, known) if m in known and m != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its first module) per strongly connected component of
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [_path_within(graph, c) for c in components]


def _path_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_submodule_imported_from_its_package_is_an_edge_to_the_submodule(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    init = pkg / "__init__.py"
    init.write_text("from p.a import x\nfrom . import b\n")
    known = {"p", "p.a", "p.b"}
    assert set(_imported("p", init, known)) == {"p.a", "p.b"}


def test_router_has_no_import_cycle():
    graph = _graph("router")
    cycles = _cycles(graph)
    assert not cycles, "import cycles in router/ (one per group of modules in a cycle):\n" + (
        "\n".join(" -> ".join(c) for c in cycles)
    )


def _crossings(package: str, forbidden: tuple[str, ...], exempt: str | None = None) -> list[str]:
    """`module imports name` for each import of `package` into a `forbidden` package."""
    out = []
    modules = _modules(package)
    for name, path in modules.items():
        if exempt is not None and (name == exempt or name.startswith(exempt + ".")):
            continue
        for imported in _imported(name, path, set(modules)):
            top = imported.split(".")[0]
            if top in forbidden:
                out.append(f"{name} imports {imported}")
    return sorted(set(out))


def test_packages_import_one_way():
    crossings = [
        *_crossings("ownerserve", ("planner", "router"), exempt="ownerserve.cli"),
        *_crossings("planner", ("router",)),
        *_crossings("workers", ("planner", "router")),
        *_crossings("loadgen", ("router", "bench")),
    ]
    assert not crossings, "\n".join(crossings)
