"""The simulated engine's cost model (``model: sim``): how long one step of an H100 serving Llama-3-8B in
bfloat16 takes, from the step's shape alone. Standard library only; ``worker/runner/sim_runner.py`` sleeps for it.

A step is a roofline: the weights are read once per step whatever its size (decode-bound while few tokens are
scheduled), the GEMMs cost 2 FLOPs per parameter per token (compute-bound from a few hundred tokens on), and
attention reads each scheduled request's whole KV context and multiplies its queries against it. Overheads
(kernel launches, the sampler, the host's share of a step under CUDA graphs) are one fixed term. The figures
land near published vLLM numbers for this pair (about 6.5 ms per decode step at small batch, a 4k-token prefill
in about 0.1 s), which is all the simulation needs: the serving layer above the engine is what it measures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SIM_MODEL = "sim"  # the ``model`` value that selects the simulated engine


@dataclass(frozen=True)
class SimCostModel:
    """Hardware and model constants (one H100 SXM5 80 GB, Llama-3-8B, bfloat16, no tensor parallelism)."""

    # NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16, 80 GB.
    hbm_bytes_per_s: float = 3.35e12
    peak_flops: float = 989e12
    hbm_capacity_bytes: int = 80 * 10**9
    # Achieved fractions: ~85% of HBM bandwidth in a decode GEMV, ~55% MFU in large prefill GEMMs (typical
    # of vLLM / TensorRT-LLM measurements on H100; an estimate, not a measurement of ours).
    bandwidth_efficiency: float = 0.85
    flops_efficiency: float = 0.55
    # Per step: launches under CUDA graphs, sampling, the host's preparation (vLLM V1: ~1 ms).
    step_overhead_s: float = 1.0e-3
    # Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336, vocab 128256,
    # 8192 positions; 8.03e9 parameters, of which 2 x 525e6 are the embedding and the LM head.
    num_layers: int = 32
    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    max_position_embeddings: int = 8192
    num_params: float = 8.03e9
    lm_head_params: float = 128256 * 4096
    dtype_bytes: int = 2  # bfloat16 weights and KV cache
    # Activations and the CUDA graphs' pools, kept out of the KV cache (vLLM's profiling finds ~2-4 GB here).
    activation_reserve_bytes: int = 3 * 10**9

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes  # ~16.1 GB: read once per step

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V: 128 KiB

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def num_blocks(self, block_size: int, gpu_memory_utilization: float) -> int:
        """KV blocks in the memory left after the weights and the activations (as vLLM's profiling sizes it)."""
        free = self.hbm_capacity_bytes * gpu_memory_utilization - self.weight_bytes - self.activation_reserve_bytes
        return max(0, int(free // self.block_bytes(block_size)))

    def step_time(self, requests: Iterable[tuple[int, int]], num_sampled: int) -> float:
        """Seconds of one step. ``requests``: (query tokens this step, context length after the step) per
        scheduled request; ``num_sampled``: rows that go through the LM head and the sampler."""
        tokens = kv_read = attn_flops = 0.0
        for query, context in requests:
            tokens += query
            kv_read += context * self.kv_bytes_per_token
            # QK^T and PV: 2 x 2 FLOPs per (query, key) pair per head dimension; causal: the queries see
            # on average context - query / 2 keys
            attn_flops += 4 * self.num_layers * self.num_heads * self.head_dim * query * (context - query / 2)
        if tokens == 0:
            return 0.0
        bandwidth = self.hbm_bytes_per_s * self.bandwidth_efficiency
        flops = self.peak_flops * self.flops_efficiency
        gemm_flops = 2 * (self.num_params - 2 * self.lm_head_params) * tokens + 2 * self.lm_head_params * num_sampled
        gemm = max(self.weight_bytes / bandwidth, gemm_flops / flops)  # roofline of the linear layers
        return self.step_overhead_s + gemm + kv_read / bandwidth + attn_flops / flops

    def hf_config(self, vocab_size: int) -> dict[str, object]:
        """The shape as a config.json mapping (the model's checks; ``vocab_size``: the tokenizer's)."""
        return {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": vocab_size,
        }
