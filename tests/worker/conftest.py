"""Worker test settings: few threads (the CPU is shared); without a CUDA GPU the Triton kernels run under
TRITON_INTERPRET=1, which must be set before triton is first imported in this process. The GGUF conversion
cache is the user's (CBSERVE_CACHE_DIR or ~/.cache/cbserve) so the bundled model is converted once."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
