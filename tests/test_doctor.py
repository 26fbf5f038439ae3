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


def test_doctor_prints_the_tested_range_and_flags_untested_versions(monkeypatch, capsys):
    import fastplug.__main__ as doctor
    from fastplug.versions import TESTED

    real = doctor.package_version
    fake = {"transformers": "5.30.0", "peft": "0.10.0", "accelerate": TESTED["accelerate"].lowest}
    monkeypatch.setattr(doctor, "package_version", lambda d: fake.get(d) or real(d))
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tf = next(line for line in lines if line.strip().startswith("transformers "))
    t = TESTED["transformers"]
    assert "5.30.0" in tf and f"tested {t.lowest} - {t.newest}" in tf
    assert f"NEWER than the newest tested ({t.newest})" in tf
    peft = next(line for line in lines if line.strip().startswith("peft "))
    assert f"OLDER than the lowest tested ({TESTED['peft'].lowest})" in peft
    accelerate = next(line for line in lines if line.strip().startswith("accelerate "))
    assert "tested" in accelerate and "NEWER" not in accelerate and "OLDER" not in accelerate
