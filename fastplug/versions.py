"""The dependency versions fastplug has been tested with, and a warning for installed ones past them.

`TESTED` is the single source of truth: pyproject.toml's lower bounds and `.ci/oldest.txt` hold its "lowest"
column, `python -m fastplug doctor` prints it beside each installed version, and the README's "Supported
versions" table is `markdown_table()` (tests/test_versions.py keeps them equal).

- lowest: the oldest release a run checked. CI's second pass (`.ci/run`, `.ci/oldest.txt`) runs the `compat`
  tests on it, except torch and triton, whose lowest is the GPU image's (torch 2.11 + triton 3.6 run
  `tests/gpu` there; the CPU passes run torch 2.13).
- newest: the newest release the full suite ran on (CI's first pass installs whatever is newest that day;
  raise these once it passes).

Versions are read from package metadata: nothing here imports torch, transformers, TRL, Lightning or
bitsandbytes.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata
from typing import NamedTuple


class Tested(NamedTuple):
    distribution: str  # the name pip knows
    lowest: str
    newest: str


TESTED: dict[str, Tested] = {
    "torch": Tested("torch", "2.11.0", "2.13.0"),
    "triton": Tested("triton", "3.6.0", "3.9.0"),
    "transformers": Tested("transformers", "5.7.0", "5.24.0"),
    "peft": Tested("peft", "0.18.0", "0.21.2"),
    "accelerate": Tested("accelerate", "1.4.0", "1.15.0"),
    "trl": Tested("trl", "1.7.0", "1.16.0"),
    "bitsandbytes": Tested("bitsandbytes", "0.46.1", "0.50.2"),
    "lightning": Tested("lightning", "2.4.0", "2.6.6"),
}


class Untested(NamedTuple):
    name: str
    installed: str
    lowest: str
    newest: str
    side: str  # "newer" or "older"


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0), "5.25.0.dev0" -> (5, 25, 0).
    Pre- and dev releases count as their release, local labels (+cpu, +cu128) are dropped."""
    numbers = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if numbers is None:
        return ()
    parts = tuple(int(part) for part in numbers.group(1).split("."))
    while len(parts) > 1 and parts[-1] == 0:  # 2.13 == 2.13.0
        parts = parts[:-1]
    return parts


def compare(installed: str, name: str) -> str | None:
    """ "newer" or "older" when `installed` lies outside the tested range of `name`, else None."""
    tested = TESTED[name]
    found = release(installed)
    if not found:
        return None
    if found > release(tested.newest):
        return "newer"
    if found < release(tested.lowest):
        return "older"
    return None


def untested_versions(sides: tuple[str, ...] = ("newer", "older")) -> list[Untested]:
    """The installed packages of TESTED whose version lies outside the tested range (on `sides`)."""
    found = []
    for name, tested in TESTED.items():
        installed = installed_version(tested.distribution)
        if installed is None:
            continue
        side = compare(installed, name)
        if side in sides:
            found.append(Untested(name, installed, tested.lowest, tested.newest, side))
    return found


def newer_than_tested() -> list[Untested]:
    """The installed packages newer than the newest version fastplug was tested with."""
    return untested_versions(sides=("newer",))


def untested_message(found: list[Untested]) -> str:
    parts = [f"{u.name} {u.installed} is newer than the newest tested ({u.newest})" for u in found]
    return (
        f"fastplug: {'; '.join(parts)}; patches are self-checked against the original modules, but report "
        "problems with the output of `python -m fastplug doctor`"
    )


_warned = False


def warn_untested_versions(stacklevel: int = 2) -> list[Untested]:
    """Warn once per process when an installed dependency is newer than the newest tested, naming both
    versions. Returns what it warned about (empty after the first call, and when all are in range).

    stacklevel counts from the function that calls this one: 1 points the warning at that call, 2 (default)
    at its caller's line, e.g. the user's `patch_model(model)` when patch_model calls it."""
    global _warned
    if _warned:
        return []
    _warned = True
    found = newer_than_tested()
    if found:
        warnings.warn(untested_message(found), UserWarning, stacklevel=stacklevel + 1)
    return found


def markdown_table() -> str:
    """The README's "Supported versions" table."""
    rows = ["| package | lowest tested | newest tested |", "|---|---|---|"]
    rows += [f"| {name} | {t.lowest} | {t.newest} |" for name, t in TESTED.items()]
    return "\n".join(rows)
