"""Test setup: without a GPU the Triton kernels run on CPU tensors under the interpreter.

TRITON_INTERPRET must be set before triton decorates any kernel, so before fastplug is imported.
"""

import os

# One GPU per pytest-xdist worker: with FASTPLUG_TEST_GPUS="0,1,2,3" (scripts/gpu_run.sh tests sets it) worker gwN
# sees only GPU N % 4. Set before torch is imported, so before CUDA reads it.
if os.environ.get("FASTPLUG_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER"):
    _gpus = os.environ["FASTPLUG_TEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % len(_gpus)]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True)
def _kernel_path(request, monkeypatch):
    """`torch_reference` tests run the kernels' torch references on CPU (fastplug reads TRITON_INTERPRET at each
    launch): a trainer's plumbing is what they test, and the interpreter would take 2.5x their CPU time."""
    marked = request.node.get_closest_marker("torch_reference") is not None
    if marked and request.node.get_closest_marker("interpreted_kernels") is None and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fp32_matmul_precision():
    """Each test starts with the process's fp32 matmul precision: TrainingArguments(bf16=True) turns TF32 on for
    the whole process (transformers' `enable_tf32`), and fp32 tolerances of later tests in the same process then
    failed on CUDA (attention patch vs transformers: 8.8e-5 against 5e-5). torch >= 2.9 has a new API (and
    raises on reading the legacy flags once it was used), which transformers then uses alone."""
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):
        saved = backends.fp32_precision
        yield
        if backends.fp32_precision != saved:
            backends.fp32_precision = saved
    else:
        saved = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
        yield
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _no_freeze_outlives_its_test(request):
    """A patch that freezes Python's collector (the trainer adapters' run) ends with its test: one left behind
    made later tests in the same worker read a freeze they did not make (a Trainer run that raised, once)."""
    yield
    host_gc = __import__("sys").modules.get("fastplug.patch.host_gc")
    if host_gc is not None and host_gc._holders:
        held, host_gc._holders = host_gc._holders, 0
        import gc

        gc.unfreeze()
        pytest.fail(f"{request.node.nodeid} left {held} hold(s) on Python's collector (a patch run not restored)")
