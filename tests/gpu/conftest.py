"""Everything in tests/gpu is marked `gpu`: realistic shapes on CUDA, checked numbers, no timings.

With FASTPLUG_TEST_REPORT set (scripts/gpu_run.sh tests), each test's outcome is appended to that file as soon as
it is known, so a run cut by its time limit still says what passed, what failed and what never reported.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_logreport(report):
    path = os.environ.get("FASTPLUG_TEST_REPORT")
    # the call phase decides, or the setup phase when it failed or skipped; under xdist only the controller
    # (no PYTEST_XDIST_WORKER) writes, once per report the workers send it
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        line = f"{outcome}\t{report.duration:.1f}\t{report.nodeid}"
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            line += "\t" + " ".join(str(message).split())[:300]
        with open(path, "a") as f:
            f.write(line + "\n")
