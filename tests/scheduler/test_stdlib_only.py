"""scheduler/ must import with the standard library only (no torch, no ray, no numpy)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cbserve.scheduler

SCHEDULER_DIR = Path(cbserve.scheduler.__file__).parent


def test_import_pulls_in_no_torch_or_ray() -> None:
    code = (
        "import sys, cbserve.scheduler, cbserve.scheduler.engine_core; "
        "bad = sorted(m for m in ('torch', 'ray', 'numpy') if m in sys.modules); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_import_is_stdlib_or_the_schedulers_own() -> None:
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    for path in sorted(SCHEDULER_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                own = name == "cbserve.scheduler" or name.startswith("cbserve.scheduler.")
                assert own or name.split(".")[0] in allowed, f"{path.name} imports {name}"
