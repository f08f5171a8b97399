"""On a CPU-only machine nothing of cbserve imports Triton: ``cbserve generate`` (which builds ``LLM()`` on the
bundled model and generates) leaves ``triton`` out of ``sys.modules`` and exits without the page of
nanobind "leaked function" lines that triton's bindings print at exit once imported.

Run in a fresh interpreter: the worker tests import triton on purpose (the interpreter tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour (CUDA uses Triton)")

_SCRIPT = """
import sys
from cbserve.cluster.cli.main import main
rc = main(["--log-level", "WARNING", "generate", "--prompt", "Hello", "--max-tokens", "3", "--device", "cpu"])
print("TRITON_LOADED", sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")))
sys.exit(rc)
"""


def test_generate_on_cpu_never_imports_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: nothing could import it")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "TRITON_LOADED []" in proc.stdout, proc.stdout
    assert "--- 'Hello'" in proc.stdout  # the generated text was printed
    noise = [line for line in proc.stderr.splitlines() if "leaked" in line or "nanobind" in line]
    assert not noise, "\n".join(noise[:5])
