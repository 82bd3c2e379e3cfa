"""The import graph of ``megatron/``: no cycle, hidden or not, and no unexplained import inside
a function.

The graph counts every import, at module level and inside functions: an import moved into a
function to dodge a cycle still closes the cycle when that function runs, so it counts here.
An import inside a function is allowed for a reason only (an optional dependency, import
cost); the reason is a comment on its line or on the line above."""

import ast
import os

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def _modules(package_dir: str) -> dict:
    """Dotted module name -> file path, for every .py file under ``package_dir``."""
    out = {}
    for folder, _, files in os.walk(os.path.join(REPO, package_dir)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return out


def _resolve(name: str, modules: dict):
    """The module ``name`` refers to (its longest prefix that is one of ours), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _imports(module: str, path: str, modules: dict):
    """(imported module of ours, the import node, inside a function?) for each import."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        yield [_resolve(n, modules) for n in names], node, id(node) in in_function


def _graph(modules: dict) -> dict:
    edges = {m: set() for m in modules}
    for module, path in modules.items():
        for targets, _, _ in _imports(module, path, modules):
            edges[module].update(t for t in targets if t is not None and t != module)
    return edges


def _cycles(edges: dict) -> list:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_megatron():
    modules = _modules("megatron")
    assert len(modules) > 100  # the walk found the package
    cycles = _cycles(_graph(modules))
    assert not cycles, "import cycles (function-level imports included): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _has_reason(lines, node) -> bool:
    line = lines[node.lineno - 1]
    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
    return "#" in line or above.startswith("#")


def test_function_level_imports_say_why():
    modules = _modules("megatron")
    silent = []
    for module, path in modules.items():
        lines = open(path).read().splitlines()
        for _, node, inside in _imports(module, path, modules):
            if inside and not _has_reason(lines, node):
                silent.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, ("imports inside functions without a reason (a comment on the line or above: optional "
                        "dependency, import cost; otherwise move it to the top):\n" + "\n".join(silent))


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    import json\n", False),
    ("def f():\n    import json  # import cost\n", True),
    ("def f():\n    # optional dependency\n    import json\n", True),
])
def test_reason_check_reads_comments(source, expected):
    lines = source.splitlines()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import))
    assert _has_reason(lines, node) is expected
