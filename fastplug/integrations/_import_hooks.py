"""Run a callback right after a module is imported, without importing it ourselves.

`import fastplug` must register Lightning strategies, but must not import Lightning (heavy, optional).
If the module is already imported the callback runs at once; otherwise a meta-path finder wraps the
module's loader so the callback runs as soon as the module has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_pending: dict[str, list[Callable]] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        # Ask the other finders for the real spec, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _CallbackLoader(spec.loader, fullname)
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in _pending.pop(self._fullname, []):
            callback(module)

    def __getattr__(self, name):  # is_package, get_code, get_resource_reader ... of the real loader
        return getattr(self._loader, name)


_finder = _AfterImportFinder()


def when_imported(module_name: str, callback: Callable) -> None:
    """Call `callback(module)` once `module_name` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
