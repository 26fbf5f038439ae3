"""Whether a benchmark worker sees flash-linear-attention (the `fla` package).

transformers picks fla's kernels for Qwen3.5 / Qwen3-Next when its modeling module is imported and `fla` imports,
and fastplug's delta rule picks them the same way, so each implementation runs in a worker that decides first:
`select(True)` puts the folder named by $FASTPLUG_BENCH_FLA (where scripts/gpu_run.sh unpacks the fla wheels) on
sys.path, `select(False)` makes `import fla` fail in this process. Call it before anything imports transformers'
models.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

ENV = "FASTPLUG_BENCH_FLA"


class _NoFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from this benchmark worker)", name=name)
        return None


def select(use_fla: bool) -> str:
    """Make `fla` importable (use_fla) or not in this process; returns words for the table's note."""
    if not use_fla:
        sys.meta_path.insert(0, _NoFla())
        return "without flash-linear-attention"
    folder = os.environ.get(ENV)
    if folder:
        sys.path.insert(0, folder)
    try:
        import fla  # noqa: F401
    except Exception as exc:  # not installed, or broken against this torch/triton
        raise RuntimeError(
            f"flash-linear-attention does not import ({type(exc).__name__}: {exc}); install fla-core or point "
            f"${ENV} at a folder holding it (scripts/gpu_run.sh unpacks .whl/fla/ there)"
        ) from exc
    import torch

    from ..kernels.delta_rule import fla_refusal

    refused = fla_refusal(torch.device("cuda")) if torch.cuda.is_available() else None
    if refused is not None:  # transformers would run fla's kernels all the same and fail in the first backward
        raise RuntimeError(refused)
    from importlib.metadata import version

    try:
        return f"fla-core {version('fla-core')}"
    except Exception:
        return "flash-linear-attention"
