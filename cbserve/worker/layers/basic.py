"""Building blocks of the Llama family, tensor-parallel aware (Megatron-style sharding).

Column-parallel layers split the output dimension across ranks; row-parallel layers split the input
dimension and sum the partial results with an all-reduce. Every parameter carries a ``weight_loader`` that
copies this rank's shard out of a full checkpoint tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import PackableLinear, PackedWeight
from cbserve.worker.parallel import all_gather_last_dim, all_reduce, divide, tp_rank, tp_world_size


class LoRASlots(Protocol):
    """A layer's LoRA adapter slots (``lora.LoRALinear``): ``step.runs`` is empty in a step without adapters."""

    step: Any

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None: ...

SKINNY_LOGITS_ROWS = 96  # up to this many sampled rows, CPU logits are computed as W @ h^T
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the fused kernels (triton_fused.py) take


def use_triton(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether the fused Triton kernels (triton_fused.py) run on x: a CUDA tensor whose data (x's own, or
    ``dtype`` where x holds something else, e.g. positions) is of a dtype they take. triton_fused (and so
    triton) is imported only once this holds: a CPU run never loads triton."""
    return x.is_cuda and (x.dtype if dtype is None else dtype) in TRITON_DTYPES


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like HF's LlamaRMSNorm; optionally fused with the residual add. With
    ``kernels`` (float32 CPU models on the native ops, see cpu/ops.py) both run as one C pass and the sum is
    written into ``residual`` in place; on CUDA likewise as one Triton kernel (triton_fused.py, same rounding).

    ``gemma``: Gemma's form, ``(1 + w) * x_normed`` with the product taken in float32 before the cast. The
    checkpoint's w is stored as 1 + w (float32) when it is loaded (the same float32 sum HF computes at every
    call), so both forms share the arithmetic (and the C kernel) in float32."""

    def __init__(self, hidden_size: int, eps: float, kernels: CpuKernels | None = None, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        # Gemma's 1 + w stays float32 in every dtype: HF adds the 1 in float32 at each call
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32 if gemma else None))
        self.weight.weight_loader = _gemma_norm_loader if gemma else _default_loader
        self.kernels = kernels

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the Triton kernel norms x: on CUDA, with a weight in x's dtype (or Gemma's float32 1 + w),
        where the torch path's result keeps x's dtype."""
        return use_triton(x) and (self.gemma or self.weight.dtype == x.dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same float32 arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * self.weight.float()).to(dtype)
        return self.weight * xf.to(dtype)

    def norm_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dimension of x [num_tokens, heads, head_dim] (q/k norms), no residual; a
        new contiguous tensor (one C pass over the rows with ``kernels``)."""
        if self.kernels is not None and x.dtype == torch.float32:
            n, heads, dim = x.shape
            return self.kernels.add_rms_norm(x.reshape(n * heads, dim), None, self.weight, self.eps)[0].view(x.shape)
        if self._fused(x):
            from cbserve.worker.cuda import triton_fused

            return triton_fused.rms_norm_heads(x, self.weight, self.eps, self.gemma)
        return self._norm(x).contiguous()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual) where new_residual = x + residual (or x)."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2 and self._fused(x):
            from cbserve.worker.cuda import triton_fused

            return triton_fused.add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
        if residual is not None:
            x = x + residual
        return self._norm(x), x


def _gemma_norm_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _default_loader(param, loaded.float() + 1.0)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's output rows split across ranks; each rank returns its slice of y.

    ``output_sizes`` lists the logical sub-matrices fused into this layer (e.g. gate and up); each is
    sharded separately so rank r holds [gate_r; up_r].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.input_size = input_size
        self.lora: LoRASlots | None = None  # adapter slots, with LoRA enabled (lora.py)
        self.output_sizes = list(output_sizes)  # the full (unsharded) sizes of the fused parts
        self.shard_sizes = [divide(s, self.tp_size, "linear output size") for s in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out))
            self.bias.weight_loader = self.weight_loader

    def _offset(self, shard_id: int) -> int:
        return sum(self.shard_sizes[:shard_id])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.shard_sizes[shard_id]
        piece = loaded.narrow(0, self.tp_rank * size, size)
        target = param.data.narrow(0, self._offset(shard_id), size)
        if target.shape != piece.shape:
            raise ValueError(
                f"weight shape mismatch: expected {tuple(target.shape)}, got {tuple(piece.shape)}"
            )
        target.copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.bias)
        if self.lora is not None and self.lora.step.runs:
            self.lora.apply(x, y)
        return y


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads (query and key/value) are split across ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        super().__init__(
            hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias
        )


class RowParallelLinear(PackableLinear):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.in_shard = divide(input_size, self.tp_size, "linear input size")
        self.output_size = output_size
        self.lora: LoRASlots | None = None  # adapter slots, with LoRA enabled (lora.py)
        self.weight = nn.Parameter(torch.empty(output_size, self.in_shard))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
            self.bias.weight_loader = _default_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _default_loader(param, loaded.narrow(1, self.tp_rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, None)
        if self.lora is not None and self.lora.step.runs:
            self.lora.apply(x, y)  # a partial product, summed by the all-reduce like the layer's own
        all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks; out-of-shard ids give 0, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // self.tp_size)  # ceil: the last shard is padded
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        end = min(self.start + self.shard, loaded.shape[0])
        param.data.zero_()
        param.data[: end - self.start].copy_(loaded[self.start : end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask.unsqueeze(-1).to(
            self.weight.dtype
        )
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head sharing VocabParallelEmbedding's sharding; logits are gathered over ranks. On CPU it can be
    packed like the linear layers (see cpu/linear.py)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self.packed: PackedWeight | None = None

    pack = PackableLinear.pack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and hidden.dtype == self.packed.dtype:
            logits = self.packed.matmul(hidden, None)
        elif hidden.device.type == "cpu" and hidden.shape[0] <= SKINNY_LOGITS_ROWS:
            # Few rows against a vocabulary-sized weight: W @ h^T streams the weight once and runs
            # 1.5-1.7x faster than h @ W^T on CPU BLAS (measured for 16-64 rows, SmolLM2's 49152 x 576).
            logits = torch.mm(self.weight, hidden.t()).t().contiguous()
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up of a fused [gate | up] projection (Gemma's GeGLU); one C pass with
    ``kernels`` (float32), one Triton kernel on CUDA."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.float32:
            return self.kernels.gelu_tanh_and_mul(x)
        if use_triton(x):
            from cbserve.worker.cuda import triton_fused

            return triton_fused.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """silu(gate) * up of a fused [gate | up] projection; one C pass with ``kernels``, one Triton kernel on CUDA."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_and_mul(x)
        if use_triton(x):
            from cbserve.worker.cuda import triton_fused

            return triton_fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
