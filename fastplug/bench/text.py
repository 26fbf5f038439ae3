"""Real text for convergence checks that needs no download: the Python standard library's own sources."""

from __future__ import annotations

import glob
import os
import sysconfig


def stdlib_bytes(n: int):
    """The first n bytes of the standard library's *.py files (sorted by name) as a long tensor of byte ids
    (a 256-token vocabulary); fewer when the library is smaller."""
    import torch

    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= n:
            break
    return torch.tensor(list(data[:n]), dtype=torch.long)
