"""fastplug's package-internal import graph, read from the source with `ast` (nothing is imported).

    python scripts/import_graph.py            # the graph grouped by layer, the layer summary, the violations
    python scripts/import_graph.py --check    # only the summary and the violations

Every `import` / `from ... import` counts, lazy ones inside functions included (only those under
`if TYPE_CHECKING:` do not: they never run). Data flows one way:

    integrations -> patch -> models -> kernels,   generate -> patch / models / kernels,
    integrations -> generate (the RL trainers' rollouts),
    config (options, versions) under all of them, and the top (fastplug/__init__, __main__, bench) over all.

Exit status 1 when a module imports from a layer it may not (an upward import) or when modules import each
other in a circle; 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "fastplug"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# the layers, lowest first; a module belongs to the first whose prefix matches its name
LAYERS = ["config", "kernels", "models", "patch", "generate", "integrations", "top"]
_PREFIXES = [
    ("config", ("fastplug.options", "fastplug.versions")),
    ("kernels", ("fastplug.kernels",)),
    ("models", ("fastplug.models",)),
    ("patch", ("fastplug.patch", "fastplug.patching")),
    ("generate", ("fastplug.generate", "fastplug.generation", "fastplug.fast_model")),
    ("integrations", ("fastplug.integrations", "fastplug.callbacks")),
    ("top", ("fastplug.bench", "fastplug.__main__", "fastplug")),
]
# which layers a layer may import from (itself included)
ALLOWED = {
    "config": {"config"},
    "kernels": {"kernels", "config"},
    "models": {"models", "kernels", "config"},
    "patch": {"patch", "models", "kernels", "config"},
    "generate": {"generate", "patch", "models", "kernels", "config"},
    "integrations": {"integrations", "generate", "patch", "models", "kernels", "config"},
    "top": set(LAYERS),
}


def layer_of(module: str) -> str:
    for layer, prefixes in _PREFIXES:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise ValueError(f"{module}: no layer")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """module name -> file, for every .py file of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _known(name: str, known: dict) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, known: dict) -> set[str]:
    """The package modules that `module` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.add(_known(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else _known(base, known))
    found.discard(None)
    found.discard(module)
    return found


def build_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) not in ALLOWED[layer_of(a)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    out.append(sorted(component))
    return out


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1 :] if module.startswith(PACKAGE + ".") else module


def report(graph: dict[str, set[str]], full: bool) -> list[str]:
    lines = []
    by_layer = defaultdict(list)
    for name in sorted(graph):
        by_layer[layer_of(name)].append(name)
    if full:
        for layer in reversed(LAYERS):
            lines.append(f"[{layer}]")
            for name in by_layer[layer]:
                targets = ", ".join(_short(t) for t in sorted(graph[name])) or "-"
                lines.append(f"  {_short(name)} -> {targets}")
        lines.append("")
    lines.append("layer summary (imports between modules, by layer; lazy imports included):")
    for layer in reversed(LAYERS):
        counts = defaultdict(int)
        for name in by_layer[layer]:
            for target in graph[name]:
                counts[layer_of(target)] += 1
        into = ", ".join(f"{target} {counts[target]}" for target in reversed(LAYERS) if counts[target]) or "nothing"
        lines.append(f"  {layer:<12} {len(by_layer[layer]):>3} modules -> {into}")
    upward = upward_imports(graph)
    circles = cycles(graph)
    lines.append(f"upward imports: {len(upward) or 'none'}")
    lines += [f"  {_short(a)} ({layer_of(a)}) -> {_short(b)} ({layer_of(b)})" for a, b in upward]
    lines.append(f"import circles: {len(circles) or 'none'}")
    lines += ["  " + " <-> ".join(_short(m) for m in circle) for circle in circles]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print only the summary and the violations")
    args = parser.parse_args(argv)
    graph = build_graph()
    print("\n".join(report(graph, full=not args.check)))
    return 1 if upward_imports(graph) or cycles(graph) else 0


if __name__ == "__main__":
    sys.exit(main())
