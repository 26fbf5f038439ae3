"""`import fastplug` stays light, and each adapter names its extra when its framework is missing."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys
import fastplug

heavy = [name for name in ("trl", "lightning", "pytorch_lightning", "transformers.trainer") if name in sys.modules]
assert not heavy, f"import fastplug imported {heavy}"

# A missing package reads as None in sys.modules: the import system then raises ImportError for it.
for name in ("trl", "lightning", "pytorch_lightning"):
    sys.modules[name] = None
for adapter, extra in (("trl", "trl"), ("lightning", "lightning")):
    try:
        __import__(f"fastplug.integrations.{adapter}")
    except ImportError as err:
        assert f'pip install "fastplug[{extra}]"' in str(err), str(err)
    else:
        raise AssertionError(f"fastplug.integrations.{adapter} imported without its framework")
print("ok")
"""


def test_import_is_light_and_adapters_name_their_extra():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
