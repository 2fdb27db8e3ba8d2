"""The product's layers: no module of datagen, flows, tasks or deployments imports the emulator
(its test double), which registers itself through entry points; a production install without it
still imports and runs every product command. ``tasks/`` never imports ``flows/``; each stage's
Prefect tasks sit in ``tasks/<stage>/task.py`` beside its plain core, which imports no Prefect task
module; ``flows/`` declares flows and their server lifecycle task, never a stage task."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("datagen", "flows", "tasks", "deployments")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def test_no_product_module_imports_the_emulator() -> None:
    offenders = [f"{p.relative_to(ROOT)}: {name}" for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
                 for name in _imports(p) if name == "emulator" or name.startswith("emulator.")]
    assert offenders == []


def test_tasks_never_import_flows() -> None:
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "tasks").rglob("*.py"))
                 for name in _imports(p) if name == "flows" or name.startswith("flows.")]
    assert offenders == []


def _task_functions(path: Path) -> list[str]:
    """The functions of ``path`` decorated with Prefect's ``@task``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if getattr(target, "id", getattr(target, "attr", "")) == "task":
                    found.append(node.name)
    return found


def test_every_stage_task_sits_beside_its_core_and_the_cores_stay_plain() -> None:
    stages = {p.relative_to(ROOT).as_posix(): _task_functions(p) for p in sorted((ROOT / "tasks").rglob("*.py"))}
    assert {path: names for path, names in stages.items() if names} == {
        "tasks/config/task.py": ["load_config"],
        "tasks/hygiene/task.py": ["hygiene"],
        "tasks/inference/task.py": ["open_datasets", "infer_dataset"],
        "tasks/server/task.py": ["launch_server", "adopt_server", "health_check", "identify_server", "diagnose_server", "stop"],
        "tasks/shards/task.py": ["prepare_run", "promote"],
        "tasks/validation/task.py": ["validate"],
    }
    # A stage's package never loads its task module: plain callers (the CLI's status, export,
    # validate) run without Prefect's task machinery.
    plain = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "tasks").rglob("*.py")) if p.name != "task.py"
             for name in _imports(p) if name.endswith(".task")]
    assert plain == []
    # flows/ holds the flows and the server lifecycle (one task per server), no stage task.
    flow_tasks = {p.name: _task_functions(p) for p in sorted((ROOT / "flows").glob("*.py"))}
    assert {name: t for name, t in flow_tasks.items() if t} == {"fleet.py": ["serve_server"]}


@pytest.mark.slow  # `datagen` subprocesses: `make test`, not `make unit`
def test_the_product_runs_without_the_emulator_installed(tmp_path: Path) -> None:
    # `emulator` made unimportable, as in an install that leaves it out: the product imports, the CLI
    # lists only its own commands, and simulated GPUs say what is missing instead of crashing.
    code = (
        "import sys, importlib.metadata as md\n"
        "sys.modules['emulator'] = None\n"
        "real = md.entry_points\n"
        "md.entry_points = lambda **kw: [] if kw.get('group', '').startswith('datagen.') else real(**kw)\n"
        "import datagen.cli, flows.datagen, tasks.gpus as g\n"
        "import os; os.environ['DATAGEN_SIM_GPUS'] = sys.argv[1]\n"
        "print(datagen.cli.main(['gpu-sim', 'show']))\n"
        "try:\n    g.sim_gpu_backend()\nexcept LookupError as exc:\n    print('lookup:', exc)\n"
    )
    env = {"PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sim.json")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "2", "lookup: no simulated GPUs are installed (entry-point group datagen.sim_gpus; the emulator package "
             "provides them)"]
    assert "unknown command 'gpu-sim'" in out.stderr
