"""Functions of fastplug with many parameters, and its longest files, read from the source with `ast`.

    python scripts/signatures.py                 # functions with >= 20 parameters, then the 15 longest files
    python scripts/signatures.py --min 12 --files 30 --under fastplug/kernels

A parameter is a name in the signature (self and *args/**kwargs count); `@triton.jit` functions are marked
`jit`, and their parameters annotated `tl.constexpr` are counted apart (constexpr / runtime). Nothing is
imported. The counts are what a reader of the signature sees: a tuple argument counts once.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _is_jit(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target).endswith("jit"):
            return True
    return False


def _is_constexpr(arg: ast.arg) -> bool:
    return arg.annotation is not None and ast.unparse(arg.annotation).endswith("constexpr")


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def files(under: Path) -> list[Path]:
    return [under] if under.is_file() else sorted(under.rglob("*.py"))


def signatures(under: Path):
    """(path, line, name, parameters, constexpr parameters, jit) for every function under `under`."""
    for path in files(under):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            yield path, node.lineno, node.name, len(params), sum(map(_is_constexpr, params)), _is_jit(node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=int, default=20, help="list functions with at least this many parameters")
    parser.add_argument("--files", type=int, default=15, help="list this many of the longest files")
    parser.add_argument(
        "--under", default="fastplug", help="the folder or file to read (relative to the repo root, or absolute)"
    )
    args = parser.parse_args()
    under = (ROOT / args.under).resolve()
    found = [s for s in signatures(under) if s[3] >= args.min]
    print(f"functions with >= {args.min} parameters under {args.under}: {len(found)}")
    for path, line, name, n, const, jit in sorted(found, key=lambda s: (-s[3], str(s[0]), s[1])):
        kind = f"jit {const} constexpr / {n - const} runtime" if jit else "host"
        print(f"  {n:3d}  {_shown(path)}:{line}  {name}  ({kind})")
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in files(under)), reverse=True)
    print(f"\nthe {args.files} longest files (lines):")
    for lines, path in sizes[: args.files]:
        print(f"  {lines:5d}  {_shown(path)}")


if __name__ == "__main__":
    main()
