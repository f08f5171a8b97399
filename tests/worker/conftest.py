"""Worker test settings: few threads (the CPU is shared). The GGUF conversion cache is the user's
(CBSERVE_CACHE_DIR or ~/.cache/cbserve) so the bundled model is converted once, not per session."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
