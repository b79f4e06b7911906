"""The import rules of docs/architecture.md (Import rules): which package may import which (checked in a fresh
interpreter per package), and no import cycles among the project's modules (checked statically)."""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The product: what users install (agents/ runs from a checkout but is product code all the same).
PRODUCT_PACKAGES = ("engine_bridge", "media", "livekit_omni", "agents")
#: The test helpers (clients, WebRTC caller, fuzzer, omni stand-in): tests and benchmarks import them, the product
#: never does, and the wheel leaves them out (tests/test_wheel_contents.py).
TEST_HELPERS = "testkit"
#: The project's own packages, whose import graph must have no cycles.
OWN_PACKAGES = (*PRODUCT_PACKAGES, TEST_HELPERS)

#: The engine's model libraries: only the engine may load them.
MODEL_LIBRARIES = ["torch", "transformers", "faster_whisper", "piper", "ctranslate2"]

# package -> top-level modules it must never pull in (directly or transitively)
FORBIDDEN: dict[str, list[str]] = {
    "engine_bridge": ["media", "livekit_omni", "livekit", "aiortc", "agents", TEST_HELPERS],
    # The media plane uses the engine's ring/control primitives only, never its models.
    "media": ["livekit_omni", "livekit", "agents", *MODEL_LIBRARIES, TEST_HELPERS],
    "livekit_omni": ["agents", *MODEL_LIBRARIES, TEST_HELPERS],
}

# Model code must not be reachable from the client-side primitives that media and livekit_omni import.
CLIENT_SIDE = [
    "engine_bridge.ring",
    "engine_bridge.control",
    "engine_bridge.client",
    "engine_bridge.protocol",
]


def _modules_of(package: str) -> list[str]:
    base = ROOT / package
    mods = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append(".".join(parts))
    return mods


def _imported_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_rules(package: str) -> None:
    loaded = _imported_after(_modules_of(package))
    bad = sorted(set(FORBIDDEN[package]) & loaded)
    assert not bad, f"importing every module of {package} pulls in forbidden {bad}"


def test_agents_only_use_livekit_omni() -> None:
    # agents/ may import livekit_omni (and livekit); it must not reach into engine internals directly.
    for path in (ROOT / "agents").glob("*.py"):
        text = path.read_text()
        assert "engine_bridge" not in text and "from media" not in text and "import media" not in text, path


def test_client_side_primitives_pull_in_no_models() -> None:
    loaded = _imported_after(CLIENT_SIDE)
    bad = sorted({*MODEL_LIBRARIES, "onnxruntime"} & loaded)
    assert not bad, f"client-side engine primitives pull in model libraries: {bad}"


# --- no import cycles ------------------------------------------------------------------------------------------
# A cycle hidden behind a function-level import still ties the modules together: neither can be understood,
# tested or replaced without the other, and moving the import to the top turns it into a partial-module
# ImportError. So the graph counts every import statement anywhere in a module (module level, functions, methods,
# try/except) with two exceptions:
# * imports under ``if TYPE_CHECKING:`` never run. With ``from __future__ import annotations`` they only name types
#   for annotations, so they add no import-order dependency; they are the sanctioned way to annotate with a type
#   from a module that depends on this one.
# * importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, but that is not counted as an edge to them:
#   a package ``__init__`` that re-exports its submodules would otherwise form a "cycle" with every submodule.
# Dynamic imports (``importlib.import_module``, e.g. the adapter registry's "module:attribute" targets) are not
# seen; the registry module is kept apart from the modules it loads so that these cannot close a cycle either.
#
# The packages in TYPE_ONLY_ACYCLIC meet the stricter rule that counts ``if TYPE_CHECKING:`` imports too: there a
# type-only import back into a module that imports this one is a cycle as well. Two modules that name each other's
# types cannot be read, tested or replaced apart; what both need goes into a module of its own (the plugin's
# options in ``livekit_omni/plugin/options.py``), and what a module needs of its caller is passed in.

#: Packages whose modules are on no import cycle even counting imports under ``if TYPE_CHECKING:``.
TYPE_ONLY_ACYCLIC = ("engine_bridge", "media", "livekit_omni")


def _is_type_checking_guard(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, *, type_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, except those in an ``if TYPE_CHECKING:`` body (unless
    ``type_only``: then those too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not type_only and isinstance(node, ast.If) and _is_type_checking_guard(node):
            todo.extend(node.orelse)  # the ``else:`` branch does run
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under each package folder of ``root``, and for every
    compiled extension module, by its type stub (``.pyi`` without a ``.py``; e.g. ``media._polyphase``): a leaf
    that imports nothing of the project, but a module of its own, not an attribute of its package."""
    out: dict[str, Path] = {}
    for package in packages:
        stubs = [p for p in (root / package).rglob("*.pyi") if not p.with_suffix(".py").exists()]
        for path in sorted([*(root / package).rglob("*.py"), *stubs]):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph(
    root: Path, packages: tuple[str, ...], *, type_only: bool = False
) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}. Only edges between the modules
    found by :func:`module_files`; third-party and standard-library imports are left out. ``type_only`` counts
    the imports under ``if TYPE_CHECKING:`` as well."""
    files = module_files(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        is_package = path.name == "__init__.py"
        here = mod if is_package else mod.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str, line: int, edges: dict[str, int] = edges, mod: str = mod) -> None:
            # The most specific project module the name refers to (``a.b.c`` may be an attribute of ``a.b``).
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != mod:
                edges.setdefault(target, line)

        for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_only=type_only):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
                continue
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
                full = f"{base}.{alias.name}"
                add(full if full in files else base, node.lineno)
        graph[mod] = edges
    return graph


def _shortest_cycle_through(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component (BFS)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is not on a cycle")


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each import cycle as ``[a, b, ..., a]``: the shortest cycle through every module that is on one
    (Tarjan's strongly connected components, then a BFS per member), without duplicates."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(root: str) -> None:
        # Iterative Tarjan (a recursive one would hit the recursion limit on a long import chain).
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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

    for mod in sorted(graph):
        if mod not in index:
            strongconnect(mod)
    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in components:
        for start in sorted(component):
            cycle = _shortest_cycle_through(graph, start, component)
            ring = cycle[:-1]
            lowest = ring.index(min(ring))
            key = tuple(ring[lowest:] + ring[:lowest])
            if key not in seen:
                seen.add(key)
                cycles.append([*key, key[0]])
    return cycles


def describe_cycles(graph: dict[str, dict[str, int]], cycles: list[list[str]]) -> str:
    lines = []
    for cycle in cycles:
        hops = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in itertools.pairwise(cycle)]
        lines.append("import cycle: " + " | ".join(hops))
    return "\n".join(lines)


def test_project_has_no_import_cycles() -> None:
    graph = import_graph(ROOT, OWN_PACKAGES)
    assert len(graph) > 50, "the import graph missed the project's modules"
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s):\n{describe_cycles(graph, cycles)}"


def test_cycle_detector_finds_a_planted_cycle(tmp_path: Path) -> None:
    """Two modules that import each other (one behind a function-level import, one through a relative import)
    plus a third that only imports under ``if TYPE_CHECKING:``: the detector reports exactly the real cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("import json\n\n\ndef f():\n    from pkg import b\n\n    return b\n")
    (pkg / "b.py").write_text("from . import a\nfrom .c import g\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.b import a\n\n\ndef g(): ...\n"
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.b": 5},
        "pkg.b": {"pkg.a": 1, "pkg.c": 2},
        "pkg.c": {},
    }
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe_cycles(graph, cycles) == "import cycle: pkg.a (line 5) -> pkg.b | pkg.b (line 1) -> pkg.a"
    # Counting type-only imports as well, pkg.c's import of pkg.b closes a second cycle.
    graph = import_graph(tmp_path, ("pkg",), type_only=True)
    assert graph["pkg.c"] == {"pkg.b": 4}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.c", "pkg.b"]]


def test_no_import_cycles_type_only_imports_included() -> None:
    """In TYPE_ONLY_ACYCLIC (livekit_omni: the plugin's model, options and sessions among them) no module is on an
    import cycle, counting ``if TYPE_CHECKING:`` imports: e.g. a session naming the model's type while the model
    imports the session is refused."""
    graph = import_graph(ROOT, OWN_PACKAGES, type_only=True)
    assert any(m.startswith("livekit_omni.plugin.") for m in graph), "the plugin was not scanned"
    cycles = [c for c in find_cycles(graph) if any(m.split(".")[0] in TYPE_ONLY_ACYCLIC for m in c)]
    assert not cycles, (
        f"{len(cycles)} import cycle(s), type-only imports counted:\n{describe_cycles(graph, cycles)}"
    )


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_product_code_never_imports_the_testing_helpers() -> None:
    """testkit (the Live test client, the WebRTC test caller, the fuzzer, the omni stand-in) is for tests and
    benchmarks only: no module of engine_bridge, media, livekit_omni or agents imports it, at any depth (the
    statically read graph, function-level imports included)."""
    graph = import_graph(ROOT, OWN_PACKAGES)
    bad = sorted(
        f"{mod} (line {line}) -> {dep}"
        for mod, deps in graph.items()
        if any(_in_package(mod, package) for package in PRODUCT_PACKAGES)
        for dep, line in deps.items()
        if _in_package(dep, TEST_HELPERS)
    )
    assert not bad, "product modules import the test helpers: " + "; ".join(bad)
    assert any(_in_package(m, TEST_HELPERS) for m in graph), "the testkit package was not scanned"
