"""Where the host's time goes in a training step: a summary of a py-spy profile (raw/collapsed format).

The GPU waits for Python when wall time per step exceeds device time (the e2e bench's wall/device column).
py-spy samples without slowing the process the way cProfile does, so the shares below are the real ones:

    py-spy record --subprocesses --format raw -r 250 -o llama.raw -- \
        python -m fastplug.bench e2e --models llama --impls fastplug --steps 12
    python scripts/host_profile.py llama.raw            # self and inclusive time of the training loop

Samples count when they lie inside `--within` (default: the bench's `train_steps`) or in another thread
than the main one (autograd's backward thread runs the custom backward functions and the checkpoint
recompute), and not inside Triton's compiler: model building and compilation do not blur the picture.
"""

from __future__ import annotations

import argparse
import collections
import re

_SETUP = ("_do_compile", "build_model", "device_ms_per_step", "_print_profile")  # not the steady state
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def _short(frame: str, with_line: bool) -> str:
    """'fn (path/to/pkg/mod.py:12)' -> 'pkg/mod.py:fn' (the last two path parts; line optional)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = "/".join(m["file"].split("/")[-2:])
    return f"{path}:{m['func']}" + (f":{m['line']}" if with_line and m["line"] else "")


def summarize(path: str, within: str, rows: int) -> str:
    self_time: collections.Counter = collections.Counter()
    self_lines: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if any(marker in fr for fr in frames for marker in _SETUP):
                continue
            keep = [i for i, fr in enumerate(frames) if within in fr]
            if keep:
                frames = frames[keep[0] + 1 :]  # below the loop function
            elif any("<module>" in fr or "runpy" in fr for fr in frames):
                continue  # the main thread outside the loop
            n = int(count)
            total += n
            if not frames:
                continue
            self_time[_short(frames[-1], False)] += n
            self_lines[_short(frames[-1], True)] += n
            for name in {_short(fr, False) for fr in frames}:
                inclusive[name] += n
    out = [f"{total} samples inside {within!r}"]
    for title, counter in (
        ("self time (leaf function)", self_time),
        ("self time by line", self_lines),
        ("inclusive time", inclusive),
    ):
        out.append(f"\n{title}:")
        out += [f"{100 * n / max(total, 1):6.1f}%  {name}" for name, n in counter.most_common(rows)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", help="py-spy --format raw output files")
    parser.add_argument("--within", default="train_steps", help="count only samples under this function")
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    for path in args.raw:
        print(f"=== {path}\n{summarize(path, args.within, args.rows)}\n")


if __name__ == "__main__":
    main()
