"""`python -m fastplug doctor` runs and says what it should: versions, device, each kernel's path."""

import subprocess
import sys

from fastplug.__main__ import PACKAGES, main


def test_doctor_prints_versions_device_and_kernel_paths(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    import torch
    import transformers

    assert torch.__version__ in out and transformers.__version__ in out
    for label, _ in PACKAGES:
        assert f"  {label} " in out
    assert "TRITON_INTERPRET=" in out
    for op in ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "cross_entropy"):
        line = next(line for line in out.splitlines() if line.strip().startswith(op + " "))
        assert "Triton" in line or "torch reference" in line


def test_missing_package_reads_not_installed():
    from fastplug.__main__ import package_version

    assert package_version("surely-not-a-real-distribution-name") == "not installed"


def test_doctor_does_not_import_trl_or_lightning():
    code = (
        "import sys; from fastplug.__main__ import main; main(['doctor']); "
        "heavy = [m for m in ('trl', 'lightning', 'pytorch_lightning') if m in sys.modules]; "
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "HEAVY []" in out
