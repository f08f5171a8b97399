"""The sparse mixture-of-experts feed-forward block of top-k softmax routers (Mixtral, Qwen3-MoE; no shared
expert), tensor-parallel aware. The families using it: ``models/mixtral.py``, ``models/qwen3_moe.py``.

Routing is HF's: ``softmax(x @ router^T)`` in float32, the top ``k`` probabilities, divided by their sum when
the model renormalises (Mixtral always; Qwen3-MoE when ``norm_topk_prob``). Each expert is a SiLU-gated MLP
(``down(silu(gate(x)) * up(x))``) built from the model's own linear layers, so the CPU packings (C panels,
oneDNN, compact bfloat16) apply to the experts as to any linear weight.

The fused expert path touches only the experts the batch routes to: the (token, expert) pairs are sorted by
expert, the routed tokens gathered once, and every routed expert runs one matmul pair over its contiguous run
of rows; the rows are put back in token order and each token's k rows weighted and summed in one batched
product. Experts no token chose are never read, which is what makes a decode step of a sparse model cheap.
That path picks the routed experts on the host (a sync and a Python loop per block). On CUDA (``use_triton``)
the block runs ``moe_triton.fused_moe`` instead: two grouped GEMMs over the experts' weights stacked once into
[E, 2I, H] and [E, H, I] (the experts' parameters become views of the stacks), sorted and padded on the device,
with no host sync, so such models' decode steps are captured as CUDA graphs (``cuda_graphs_blocker``).

Tensor parallelism splits every expert's intermediate dimension across ranks (gate/up column-parallel, down
row-parallel); the router is replicated, so every rank routes identically, and the partial sums of all experts
are all-reduced once per block.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear, SiluAndMul, _default_loader, use_triton
from cbserve.worker.parallel import all_reduce


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one sparse block."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # of one expert
    renormalize: bool  # divide the top-k probabilities by their sum

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")

    @classmethod
    def mixtral(cls, cfg: Any) -> MoEConfig:
        _check_act(cfg)
        return cls(int(cfg.num_local_experts), int(cfg.num_experts_per_tok), int(cfg.hidden_size),
                   int(cfg.intermediate_size), True)

    @classmethod
    def qwen3_moe(cls, cfg: Any) -> MoEConfig:
        _check_act(cfg)
        return cls(int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.hidden_size),
                   int(cfg.moe_intermediate_size), bool(getattr(cfg, "norm_topk_prob", False)))


def _check_act(cfg: Any) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported for experts (silu only)")


class MoEExpert(nn.Module):
    """One SiLU-gated expert; ``forward`` returns this rank's partial sum (not all-reduced)."""

    def __init__(self, hidden: int, inter: int, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False)
        self.down_proj = RowParallelLinear(inter, hidden, False)
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.linear(self.act(self.gate_up_proj.linear(x, None)), None)


class MoERouter(nn.Module):
    """The replicated router weight [num_experts, hidden] (kept dense: F.linear, as HF computes it, so the
    choice of experts does not move with a packing's summation order)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.weight.weight_loader = _default_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """x [n, hidden] -> sum over each token's top-k experts of weight * expert(x)."""

    def __init__(self, moe: MoEConfig, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.gate = MoERouter(moe.num_experts, moe.hidden_size)
        self.experts = nn.ModuleList(
            MoEExpert(moe.hidden_size, moe.intermediate_size, kernels) for _ in range(moe.num_experts)
        )
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up, down): see stacked_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] in x's dtype, expert ids [n, k]) of every token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if use_triton(x) and self.experts[0].gate_up_proj.weight.dtype == x.dtype:
            from cbserve.worker.cuda import moe_triton

            return all_reduce(moe_triton.fused_moe(x, *self.stacked_weights(), weights, ids))
        return all_reduce(fused_experts(x, weights, ids, self.experts))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) of this rank's expert shards, for the grouped GEMMs of
        ``moe_triton``. Built once, on first use on the weights' device: the experts' weights are stacked and
        every expert's parameter is then made a view into the stack (its own storage is freed, so memory does
        not double, and later loads through the weight loaders land in the stack). Rebuilt when the experts'
        weights no longer live there (the model was moved, or a parameter replaced)."""
        first = self.experts[0]
        if self._stacked is not None and _is_view_of(first.gate_up_proj.weight, self._stacked[0]) and \
                _is_view_of(first.down_proj.weight, self._stacked[1]):
            return self._stacked
        stacks = []
        for kind in ("gate_up_proj", "down_proj"):
            params = [getattr(e, kind).weight for e in self.experts]
            with torch.inference_mode(False):  # a normal tensor, as the parameters were: later loads can write it
                stack = torch.stack([p.data for p in params])
            for i, p in enumerate(params):
                p.data = stack[i]
            stacks.append(stack)
        self._stacked = (stacks[0], stacks[1])
        return self._stacked

    def load_stacked(self, kind: str, tensor: torch.Tensor) -> None:
        """Load the experts from HF's stacked 3-D form (see ``split_stacked``)."""
        for i, shard, piece in split_stacked(kind, tensor, self.moe.num_experts, self.moe.intermediate_size):
            proj = getattr(self.experts[i], kind)
            if shard is None:
                proj.weight.weight_loader(proj.weight, piece)
            else:
                proj.weight.weight_loader(proj.weight, piece, shard)


HOST_ROUTING = "mixture-of-experts blocks run only the routed experts, chosen on the host each step"


def cuda_graphs_blocker(expert_weights: Iterable[Any]) -> str | None:
    """Why decode steps of a model with these sparse blocks (one expert weight of each block given) cannot be
    captured as CUDA graphs, None when they can: on CUDA in a Triton dtype every block runs ``moe_triton``
    (no host sync, launch grids fixed by the token count); anywhere else ``fused_experts`` picks the routed
    experts on the host."""
    return None if all(use_triton(w) for w in expert_weights) else HOST_ROUTING


def _is_view_of(param: torch.Tensor, stack: torch.Tensor) -> bool:
    """Whether param is expert 0's slice of stack (host-side pointer and shape checks only)."""
    return param.data_ptr() == stack.data_ptr() and param.device == stack.device and param.shape == stack.shape[1:]


def split_stacked(
    kind: str, tensor: torch.Tensor, num_experts: int, inter: int
) -> list[tuple[int, int | None, torch.Tensor]]:
    """(expert, shard of its fused weight, tensor) of one stacked 3-D expert weight, as transformers 5 holds
    them in memory: ``gate_up_proj`` [E, 2 * inter, hidden] ([gate; up] per expert) or ``down_proj``
    [E, hidden, inter]."""
    if kind not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"unknown stacked expert weight {kind!r}")
    rows = 2 * inter if kind == "gate_up_proj" else None
    if tensor.dim() != 3 or tensor.shape[0] != num_experts or (rows is not None and tensor.shape[1] != rows):
        raise ValueError(f"stacked expert weight {kind} has shape {tuple(tensor.shape)}; want {num_experts} "
                         f"experts{'' if rows is None else f' of {rows} rows'}")
    if kind == "down_proj":
        return [(i, None, tensor[i]) for i in range(num_experts)]
    return [(i, s, tensor[i, s * inter : (s + 1) * inter]) for i in range(num_experts) for s in (0, 1)]


def fused_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """Sum over k of ``weights[t, k] * experts[ids[t, k]](x[t])`` for every token t, running each routed
    expert once over all of its tokens (one matmul pair per routed expert; unrouted experts are skipped)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=len(experts))
    routed = torch.nonzero(counts).flatten()
    ends = counts.cumsum(0)
    token = order // k
    xs = x.index_select(0, token)
    ys = torch.empty_like(xs)
    for e, end, c in zip(routed.tolist(), ends[routed].tolist(), counts[routed].tolist(), strict=True):
        ys[end - c : end] = experts[e](xs[end - c : end])
    # back to (token, slot) order, then each token's k rows weighted and summed in one batched product
    # (index_add_ would do it in place, but CPU scatter-add runs orders of magnitude slower)
    ys = ys.index_select(0, torch.argsort(order)).view(n, k, x.shape[1])
    return torch.bmm(weights.unsqueeze(1).to(ys.dtype), ys).squeeze(1)


# ---- checkpoint names ---------------------------------------------------------------------------------
_MIXTRAL_EXPERT = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


def map_expert_name(name: str) -> tuple[str, int | None] | None:
    """A checkpoint name of a sparse block -> (this model's parameter, shard of a fused weight), or None when
    the name is no expert/router weight. Mixtral's ``block_sparse_moe.{gate, experts.N.w1/w2/w3}`` and
    Qwen-MoE's ``mlp.{gate, experts.N.gate_proj/up_proj/down_proj}`` both land on
    ``mlp.{gate, experts.N.gate_up_proj/down_proj}``. Stacked 3-D names are cut by ``split_stacked``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if "mlp" not in parts:
        return None
    i = parts.index("mlp")
    tail = parts[i + 1 :]
    if tail == ["gate", "weight"]:
        return name, None
    if len(tail) == 4 and tail[0] == "experts" and tail[1].isdigit() and tail[3] == "weight":
        proj = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                **_MIXTRAL_EXPERT}.get(tail[2])
        if proj is None:
            return None
        return ".".join([*parts[: i + 3], proj[0], "weight"]), proj[1]
    return None
