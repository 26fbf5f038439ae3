"""`python -m fastplug doctor`: what fastplug will run on this machine, for bug reports and GPU checks.

Prints the versions of the libraries fastplug works with (read from package metadata, so nothing heavy
such as TRL or Lightning is imported) beside the range fastplug was tested with (fastplug/versions.py),
flagging those outside it, the device, and which path each kernel takes on it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

# Distribution names as pip knows them; (label, distribution).
PACKAGES = (
    ("torch", "torch"),
    ("triton", "triton"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("accelerate", "accelerate"),
    ("trl", "trl"),
    ("bitsandbytes", "bitsandbytes"),
    ("datasets", "datasets"),
    ("lightning", "lightning"),
    ("pytorch-lightning", "pytorch-lightning"),
    ("liger-kernel", "liger-kernel"),
)


def package_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def package_lines() -> list[str]:
    """One line a package: installed version, tested range, and a flag when it lies outside the range."""
    from .versions import TESTED, compare

    width = max(len(label) for label, _ in PACKAGES)
    versions = {label: package_version(distribution) for label, distribution in PACKAGES}
    vwidth = max(len(v) for v in versions.values())
    lines = []
    for label, _ in PACKAGES:
        version = versions[label]
        line = f"{label:<{width}}  {version:<{vwidth}}"
        if label in TESTED:
            tested = TESTED[label]
            line += f"  tested {tested.lowest} - {tested.newest}"
            side = compare(version, label) if version != "not installed" else None
            if side == "newer":
                line += f"  <- NEWER than the newest tested ({tested.newest})"
            elif side == "older":
                line += f"  <- OLDER than the lowest tested ({tested.lowest})"
        lines.append(line.rstrip())
    return lines


def device_lines(torch) -> list[str]:
    if not torch.cuda.is_available():
        return ["cuda: not available (CPU only)"]
    lines = [f"cuda: {torch.version.cuda}, {torch.cuda.device_count()} device(s)"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(
            f"cuda:{i}: {props.name}, capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"
        )
    return lines


def kernel_lines(torch) -> tuple[list[str], bool]:
    """Which path each public kernel takes on the default device; False when the kernels don't import."""
    try:
        import fastplug.kernels as kernels
        from fastplug.kernels._utils import kernel_path
        from fastplug.kernels.fp8 import FP8_OPS, fp8_path
    except Exception as exc:  # a broken install is exactly what doctor is for: say what failed
        return [f"fastplug.kernels failed to import: {type(exc).__name__}: {exc}"], False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = kernel_path(device)
    ops = [name for name in kernels.__all__ if not name.endswith("_reference") and name[0].islower()]
    width = max(len(op) for op in ops)
    # FP8 ops have their own condition: FP8 tensor cores (capability 8.9+), else dequantize + matmul
    lines = [f"{op:<{width}}  {fp8_path(device, op) if op in FP8_OPS else path}" for op in ops]
    if device == "cuda":
        lines.append(f"(CPU tensors: {kernel_path('cpu')})")
    return lines, True


def doctor() -> int:
    import torch

    import fastplug

    print(f"fastplug {fastplug.__version__} at {os.path.dirname(fastplug.__file__)}")
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    print("\npackages:")
    for line in package_lines():
        print(f"  {line}")
    print("\ndevice:")
    for line in device_lines(torch):
        print(f"  {line}")
    print(f"  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}")
    lines, ok = kernel_lines(torch)
    print("\nkernels:")
    for line in lines:
        print(f"  {line}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, device and the path each kernel takes")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
