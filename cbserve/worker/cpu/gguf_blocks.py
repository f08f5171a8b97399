"""GGUF weights kept in their quantized blocks for the CPU linear kernel (``csrc/panels.h``).

A GGUF file's Q8_0, Q4_0 and Q4_1 tensors decode to float32 values that need far fewer bytes than float32:
w = d * q (+ m) with float16 scales per 32 values; its K-quants Q4_K, Q5_K and Q6_K (what most downloaded GGUF
files ship: Q4_K_M holds Q4_K and Q6_K) add integer sub-scales per 32 or 16 values under float16 ones per 256.
transformers dequantizes them into the dense float32
checkpoint cbserve converts GGUF files to (``model_loader.convert_gguf``); this module keeps, next to it, the
raw blocks of every such weight, in the row order of the HF tensor, after checking that they dequantize to
exactly the checkpoint's values. The native CPU kernels then stream the blocks instead of the float32
weights and compute the same float32 products (``linear.py`` checks the packing once more, value for value,
against the weight it replaces).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CHUNK_ROWS = 8192  # rows dequantized at once (an embedding's intermediates stay small)

BLOCKS_FILE = Path("cbserve-gguf-blocks") / "blocks.safetensors"
BLOCK_K = 32
# GGUF block layouts: bytes of one block (of 32 values; of 256 for the K-quants).
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


@dataclass(frozen=True)
class QuantBlocks:
    """A [n, k] weight as GGUF blocks: ``raw`` is uint8 [n, k / 32 * BLOCK_BYTES[qtype]], rows in HF order."""

    qtype: str
    raw: torch.Tensor

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported GGUF block type {self.qtype!r} (supported: {sorted(BLOCK_BYTES)})")
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2 or self.raw.shape[1] % BLOCK_BYTES[self.qtype]:
            raise ValueError(f"{self.qtype} blocks must be a uint8 matrix of whole blocks, got "
                             f"{self.raw.dtype} {tuple(self.raw.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] // BLOCK_BYTES[self.qtype] * BLOCK_VALUES[self.qtype]

    def _blocks(self) -> torch.Tensor:
        n = self.raw.shape[0]
        return self.raw.contiguous().view(n, -1, BLOCK_BYTES[self.qtype])

    def _scale(self, blocks: torch.Tensor, offset: int) -> torch.Tensor:
        return blocks[:, :, offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float().contiguous()

    def q8_0(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d [n, k / 32] float32, q [n, k] int8) with w = d * q."""
        if self.qtype != "Q8_0":
            raise ValueError(f"{self.qtype} blocks are not Q8_0")
        b = self._blocks()
        return self._scale(b, 0).contiguous(), b[:, :, 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1)

    def q4_0(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d [n, k / 32] float32, q [n, k] uint8 in 0..15) with w = d * (q - 8)."""
        if self.qtype != "Q4_0":
            raise ValueError(f"{self.qtype} blocks are not Q4_0")
        b = self._blocks()
        qs = b[:, :, 2:]
        # byte j of a block holds value j in its low nibble and value j + 16 in its high one
        q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(b.shape[0], -1)
        return self._scale(b, 0).contiguous(), q.contiguous()

    def q4_1(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(d, m [n, k / 32] float32, q [n, k] uint8 in 0..15) with w = d * q + m; Q4_0 (w = d * (q - 8)) as
        m = -8d, which gives the same float32 values: d * q - 8d = d * (q - 8) is exact."""
        if self.qtype not in ("Q4_0", "Q4_1"):
            raise ValueError(f"{self.qtype} blocks are not Q4_0 or Q4_1")
        b = self._blocks()
        d = self._scale(b, 0)
        m = -8.0 * d if self.qtype == "Q4_0" else self._scale(b, 2)
        qs = b[:, :, 2:] if self.qtype == "Q4_0" else b[:, :, 4:]
        # byte j of a block holds value j in its low nibble and value j + 16 in its high one
        q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(b.shape[0], -1)
        return d.contiguous(), m.contiguous(), q.contiguous()

    def q5_0(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d [n, k / 32] float32, q [n, k] uint8 in 0..31) with w = d * (q - 16): a Q5_0 block is float16 d, 4 bytes
        of fifth bits (bit j: value j) and 16 bytes of nibbles as Q4_0's (byte j: values j and j + 16)."""
        b = self._checked_blocks("Q5_0")
        n = b.shape[0]
        qs = b[:, :, 6:]
        low = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, -1)
        qh = b[:, :, 2:6].reshape(n, -1, 4, 1)
        fifth = torch.cat([(qh >> i) & 1 for i in range(8)], dim=3).reshape(n, -1)  # bit i of byte t: value 8t + i
        return self._scale(b, 0), (low | fifth << 4).contiguous()

    def q4_k(self) -> tuple[torch.Tensor, ...]:
        """(d, dmin [n, k / 256] float32, sc, m [n, k / 32] uint8 in 0..63, q [n, k] uint8 in 0..15) with
        w = d * sc * q - dmin * m: a Q4_K block is float16 d and dmin, 12 bytes of 6-bit scales and mins, then
        128 bytes whose low nibbles hold one 32-value block and high nibbles the next (gguf-py's order)."""
        return self._q45_k("Q4_K")

    def q5_k(self) -> tuple[torch.Tensor, ...]:
        """As ``q4_k`` with q in 0..31: a Q5_K block has 32 bytes of fifth bits (bit i of byte j: value j of the i-th
        32-value block) between the scales and the nibbles."""
        return self._q45_k("Q5_K")

    def _q45_k(self, qtype: str) -> tuple[torch.Tensor, ...]:
        b = self._checked_blocks(qtype)
        n, nb = b.shape[:2]
        packed = b[:, :, 4:16].reshape(n, nb, 3, 4)
        dd, mm, md = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        sc = torch.cat([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], dim=2).reshape(n, -1)
        m = torch.cat([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], dim=2).reshape(n, -1)
        qs = b[:, :, -128:].reshape(n, nb, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1)
        if qtype == "Q5_K":
            qh = b[:, :, 16:48].reshape(n, nb, 1, 32)
            q |= (torch.cat([(qh >> i) & 1 for i in range(8)], dim=2).reshape(n, -1) << 4)
        return self._scale(b, 0), self._scale(b, 2), sc.contiguous(), m.contiguous(), q.contiguous()

    def q6_k(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(d [n, k / 256] float32, sc [n, k / 16] int8, q [n, k] uint8 in 0..63) with w = d * sc * (q - 32): a
        Q6_K block is 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales and float16 d."""
        b = self._checked_blocks("Q6_K")
        n, nb = b.shape[:2]
        ql = b[:, :, :128].reshape(n, nb, 2, 1, 64)
        ql = torch.cat([ql & 15, ql >> 4], dim=3)
        qh = b[:, :, 128:192].reshape(n, nb, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)
        q = ql.reshape(n, -1) | (qh.reshape(n, -1) << 4)
        sc = b[:, :, 192:208].contiguous().view(torch.int8).reshape(n, -1)
        return self._scale(b, 208), sc.contiguous(), q.contiguous()

    def _checked_blocks(self, qtype: str) -> torch.Tensor:
        if self.qtype != qtype:
            raise ValueError(f"{self.qtype} blocks are not {qtype}")
        return self._blocks()


@dataclass(frozen=True)
class SplitBlocks:
    """A fused weight's GGUF blocks in row ranges of different types, in row order (Q4_K_M's q and k in Q4_K, its v
    in Q6_K): each range is packed in its own format (``linear.SplitWeight``)."""

    parts: tuple[QuantBlocks, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)


def fuse_blocks(parts: list[QuantBlocks]) -> QuantBlocks | SplitBlocks:
    """The blocks of a weight fused from ``parts`` (in row order): one ``QuantBlocks`` where they share a type,
    else a ``SplitBlocks`` of the runs of one type."""
    runs: list[list[QuantBlocks]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    fused = [QuantBlocks(run[0].qtype, torch.cat([b.raw for b in run])) if len(run) > 1 else run[0] for run in runs]
    return fused[0] if len(fused) == 1 else SplitBlocks(tuple(fused))


def _dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType

    return dequantize_rows(raw, GGMLQuantizationType[qtype])


def dequantize_rows(data: np.ndarray, qtype: Any, rows: int = CHUNK_ROWS) -> np.ndarray:
    """gguf's ``dequantize`` of a tensor's rows, ``rows`` at a time into one output: its intermediates (several times
    the output for a block format) stay a chunk's size, not a whole embedding's."""
    from gguf.quants import dequantize

    if data.ndim < 2 or data.shape[0] <= rows:
        return dequantize(data, qtype)
    first = dequantize(data[:rows], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:rows] = first
    for i in range(rows, data.shape[0], rows):
        out[i : i + rows] = dequantize(data[i : i + rows], qtype)
    return out


def _row_orders(gguf_name: str, n: int, cfg: Any) -> list[np.ndarray]:
    """Candidate row orders of a GGUF tensor: as stored, and for q/k projections llama.cpp's rotary
    permutation undone (what transformers does for the Llama family); the checked one is kept."""
    orders = [np.arange(n)]
    heads = {"attn_q": getattr(cfg, "num_attention_heads", None),
             "attn_k": getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)}
    for part, h in heads.items():
        if f".{part}." in gguf_name and h and n % (2 * h) == 0:
            orders.append(np.arange(n).reshape(h, n // h // 2, 2).swapaxes(1, 2).reshape(n))
    return orders


def _name_mapper(reader: Any, cfg: Any) -> Callable[[str], str | None]:
    import gguf

    field = reader.fields.get("general.architecture")
    arch_name = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        return lambda _name: None
    name_map = gguf.get_tensor_name_map(arch, int(cfg.num_hidden_layers))
    return lambda base: name_map.get_name(base)


class BlockExtractor:
    """The GGUF file's quantized tensors, to keep each dequantized weight's blocks as it comes (``take``)."""

    def __init__(self, reader: Any, cfg: Any) -> None:
        """``reader``: the file's ``GGUFReader``."""
        self.cfg = cfg
        self.to_gguf = _name_mapper(reader, cfg)
        self.tensors = {t.name: t for t in reader.tensors}

    def take(self, hf_name: str, ref: torch.Tensor) -> QuantBlocks | None:
        """The blocks of weight ``hf_name`` (dequantized: ``ref``) when a GGUF tensor of a supported type holds it
        exactly; None otherwise (it stays dense)."""
        if ref.dim() != 2 or not hf_name.endswith(".weight") or ref.dtype != torch.float32:
            return None
        gguf_name = self.to_gguf(hf_name.removesuffix(".weight"))
        tensor = self.tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None or tensor.tensor_type.name not in BLOCK_BYTES:
            return None
        try:
            blocks = _matching_blocks(tensor, ref, self.cfg)
        except (ValueError, TypeError, NotImplementedError) as e:  # an unexpected layout: this weight stays dense
            logger.info("GGUF tensor %s not kept as blocks (%s)", tensor.name, e)
            return None
        if blocks is None:
            logger.info("GGUF tensor %s does not dequantize to %s exactly: kept dense", tensor.name, hf_name)
        return blocks


def extract_gguf_blocks(gguf_path: Path, cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, QuantBlocks]:
    """The blocks of every 2-D weight of ``state`` (the dequantized checkpoint) that a GGUF tensor of a
    supported type holds exactly; weights that do not check out are left out (they stay dense)."""
    from gguf import GGUFReader

    extractor = BlockExtractor(GGUFReader(str(gguf_path)), cfg)
    return {name: b for name, ref in state.items() if (b := extractor.take(name, ref)) is not None}


def _matching_blocks(tensor: Any, ref: torch.Tensor, cfg: Any) -> QuantBlocks | None:
    """The tensor's blocks in the row order that dequantizes to ``ref`` exactly, or None."""
    raw = np.asarray(tensor.data).reshape(ref.shape[0], -1)
    want = ref.contiguous().numpy().view(np.uint32)
    qtype, n = tensor.tensor_type.name, ref.shape[0]
    for order in _row_orders(tensor.name, n, cfg):
        rows = raw[order]
        if all(_same(_dequantize(rows[i : i + CHUNK_ROWS], qtype), want[i : i + CHUNK_ROWS])
               for i in range(0, n, CHUNK_ROWS)):  # fmt: skip  (a chunk at a time: no full float32 copy)
            return QuantBlocks(qtype, torch.from_numpy(np.ascontiguousarray(rows)))
    return None


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got.astype(np.float32).view(np.uint32), want)


def save_gguf_blocks(folder: Path, blocks: dict[str, QuantBlocks]) -> None:
    """Save ``blocks`` next to a converted checkpoint (nothing when there are none: safetensors writes an
    unreadable file for an empty dict with metadata)."""
    if not blocks:
        return
    from safetensors.torch import save_file

    path = folder / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: b.raw for name, b in blocks.items()}, str(path),
              metadata={name: b.qtype for name, b in blocks.items()})


def load_gguf_blocks(folder: Path) -> dict[str, QuantBlocks]:
    """The blocks saved next to a converted GGUF checkpoint ({} for any other folder, and, with a warning,
    for a file that cannot be read: the blocks are an optimisation, the dense checkpoint is the model)."""
    path = folder / BLOCKS_FILE
    if not path.exists():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {name: QuantBlocks(meta[name], f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types; any means: not usable)
        logger.warning("GGUF blocks in %s not used (%s: %s); the weights stay float32", path, type(e).__name__, e)
        return {}
