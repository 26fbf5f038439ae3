"""fastplug/versions.py: the tested range, the once-per-process warning for newer installs, the README's table."""

import warnings
from pathlib import Path

import pytest

from fastplug import versions
from fastplug.versions import TESTED


@pytest.fixture
def installed(monkeypatch):
    """Pretend these versions are installed (the rest: the newest tested); reset the once-per-process flag."""
    fake = {t.distribution: t.newest for t in TESTED.values()}
    monkeypatch.setattr(versions, "installed_version", lambda distribution: fake.get(distribution))
    monkeypatch.setattr(versions, "_warned", False)
    return fake


def test_table_is_ordered_and_covers_the_patched_libraries():
    for name in ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "lightning", "torch", "triton"):
        low, new = versions.release(TESTED[name].lowest), versions.release(TESTED[name].newest)
        assert low and low <= new, name


def test_release_ignores_local_labels_and_trailing_zeros():
    assert versions.release("2.13.0+cpu") == versions.release("2.13") == (2, 13)
    assert versions.release("5.25.0.dev0") == (5, 25)
    assert versions.compare("2.13.0+cu128", "torch") is None
    assert versions.compare("5.30.0", "transformers") == "newer"
    assert versions.compare("4.57.1", "transformers") == "older"
    assert versions.compare("not a version", "transformers") is None


def test_newer_install_warns_once_naming_both_versions(installed):
    installed["transformers"] = "5.30.0"
    with pytest.warns(UserWarning) as record:
        found = versions.warn_untested_versions(stacklevel=1)
    assert [u.name for u in found] == ["transformers"]
    (warning,) = [w for w in record if "fastplug" in str(w.message)]
    message = str(warning.message)
    assert "transformers 5.30.0" in message and f"newest tested ({TESTED['transformers'].newest})" in message
    assert warning.filename == __file__  # stacklevel=1: the line that called it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert versions.warn_untested_versions() == []  # once per process


def test_all_newer_packages_are_named_in_one_warning(installed):
    installed["peft"], installed["bitsandbytes"] = "0.30.0", "1.0.0"
    with pytest.warns(UserWarning, match=r"peft 0\.30\.0 .*bitsandbytes 1\.0\.0"):
        found = versions.warn_untested_versions()
    assert {u.name for u in found} == {"peft", "bitsandbytes"}


def test_in_range_older_and_missing_packages_do_not_warn(installed):
    installed["transformers"] = TESTED["transformers"].lowest
    installed["trl"] = "0.29.0"  # older: doctor flags it, the patch-time warning is only for newer releases
    del installed["lightning"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert versions.warn_untested_versions() == []
    assert [(u.name, u.side) for u in versions.untested_versions()] == [("trl", "older")]


def test_reading_versions_imports_no_heavy_library():
    import subprocess
    import sys

    code = (
        "import sys; from fastplug import versions; versions.untested_versions(); versions.warn_untested_versions(); "
        "print('HEAVY', [m for m in ('torch', 'transformers', 'trl', 'lightning', 'bitsandbytes', 'peft') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out


def test_readme_table_is_the_tested_table():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert versions.markdown_table() in readme


def test_oldest_constraints_and_pyproject_lower_bounds_are_the_lowest_tested():
    root = Path(__file__).parents[1]
    oldest = (root / ".ci" / "oldest.txt").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    for name, tested in TESTED.items():
        assert f'"{tested.distribution}>={tested.lowest}' in pyproject, name
        if name != "torch":  # the CPU passes run torch 2.13; torch 2.11 is the GPU image's
            assert f"{tested.distribution}=={tested.lowest}\n" in oldest, name
