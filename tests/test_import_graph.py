"""The package-internal import graph (scripts/import_graph.py): no module imports from a layer above its own
and no modules import each other in a circle, lazy imports inside functions included."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_upward_import_and_no_circle():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "upward imports: none" in done.stdout and "import circles: none" in done.stdout


def test_the_check_finds_an_upward_import_and_a_circle(tmp_path):
    graph_tool = _import_graph()
    package = tmp_path / "fastplug"
    files = {
        "__init__.py": "",
        "options.py": "",
        "kernels/__init__.py": "",
        "kernels/norms.py": "def f():\n    from ..models import rules  # lazy, still counted\n",
        "kernels/a.py": "from . import b\n",
        "kernels/b.py": "from .a import x\n",
        "models/__init__.py": "",
        "models/rules.py": "from ..kernels import norms\nfrom ..options import KernelOptions\n",
        "models/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..patch import engine\n",
        "patch/__init__.py": "",
        "patch/engine.py": "from ..models.rules import x\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    graph = graph_tool.build_graph(package)
    assert graph["fastplug.kernels.norms"] == {"fastplug.models.rules"}
    assert graph["fastplug.models.typed"] == set(), "imports under TYPE_CHECKING never run"
    assert graph_tool.upward_imports(graph) == [("fastplug.kernels.norms", "fastplug.models.rules")]
    circles = graph_tool.cycles(graph)
    assert ["fastplug.kernels.a", "fastplug.kernels.b"] in circles
    assert ["fastplug.kernels.norms", "fastplug.models.rules"] in circles
