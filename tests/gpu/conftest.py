"""Everything in tests/gpu is marked `gpu`: realistic shapes on CUDA, checked numbers, no timings."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
