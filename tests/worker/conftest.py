"""Worker test settings: few threads (the CPU is shared); without a CUDA GPU the Triton kernels run under
TRITON_INTERPRET=1, which must be set before triton is first imported in this process. The GGUF conversion
cache is the user's (CBSERVE_CACHE_DIR or ~/.cache/cbserve) so the bundled model is converted once."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.native import load_cpu_kernels

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with grouped-query attention (worker_testlib.make_tiny_model)."""
    from worker_testlib import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gqa"), "llama_gqa")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama 3 with tied embeddings."""
    from worker_testlib import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tied"), "llama3_tied")


@pytest.fixture(scope="session")
def kernels() -> CpuKernels:
    """cbserve's CPU kernels (built on first use); the tests that take it skip without a C compiler."""
    load = load_cpu_kernels()
    assert load.kernels is not None, load.reason
    return load.kernels


@pytest.fixture(scope="session")
def triton_kernels_module() -> ModuleType:
    """cbserve's Triton launchers module. Without CUDA the kernels must run interpreted, which needs
    TRITON_INTERPRET=1 *before triton is first imported* in this process (triton's own tl.* helpers are
    decorated at import); the kernels module is re-imported if it was first imported without it."""
    pytest.importorskip("triton")
    from cbserve.worker.attention import triton_kernels

    if torch.cuda.is_available():
        return triton_kernels
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    from cbserve.worker.attention import triton_jit

    if not isinstance(triton_jit._prefill_kernel, InterpretedFunction):
        importlib.reload(triton_jit)  # the launchers look kernels up on the module at each launch
    return triton_kernels
