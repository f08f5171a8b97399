"""The C kernels' one ABI header (worker/cpu/csrc/cb_cpu.h) against the ctypes table (worker/cpu/abi.py):
they agree, every exported symbol is declared and bound, and a drift on either side is an error at load."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cbserve.worker.cpu import abi
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels

needs_cc = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
HEADER_TEXT = abi.HEADER.read_text()


def _mutated(old: str, new: str) -> str:
    assert HEADER_TEXT.count(old) == 1, old
    return HEADER_TEXT.replace(old, new)


def test_header_declares_what_the_ctypes_table_binds() -> None:
    header = abi.parse_header(HEADER_TEXT)
    assert set(header.functions) == set(abi.FUNCTIONS) and len(header.functions) == 29
    assert header.functions["cb_packed_bytes"] == abi.FUNCTIONS["cb_packed_bytes"]
    assert set(header.structs) == {"cb_lin_t", "cb_layer_t", "cb_model_t"}
    abi.check(HEADER_TEXT)  # no difference


@pytest.mark.parametrize(
    "old,new,complaint",
    [
        # an argument's type changes (int64_t -> int): the prototype no longer matches the binding
        ("cb_pack_weight_f32(const float *w, int64_t ldw,", "cb_pack_weight_f32(const float *w, int ldw,",
         r"cb_pack_weight_f32: cb_cpu\.h has c_int\(c_void_p, c_int, "),
        # an argument is added
        ("int window, float softcap);\n\n/* ---- every", "int window, float softcap, int extra);\n\n/* ---- every",
         "cb_paged_decode_f32: cb_cpu.h has"),
        # the return type changes
        ("CB_API int cb_gemm_panel_width(void);", "CB_API int64_t cb_gemm_panel_width(void);",
         "cb_gemm_panel_width: cb_cpu.h has c_long"),
        # a function is exported that Python does not bind
        ("CB_API int cb_gemm_panel_width(void);", "CB_API int cb_gemm_panel_width(void);\nCB_API int cb_new(int a);",
         "cb_new: exported by cb_cpu.h but not bound"),
        # a bound function is no longer declared
        ("CB_API int cb_gemm_panel_width(void);", "int cb_gemm_panel_width(void);",
         "cb_gemm_panel_width: bound in abi.FUNCTIONS but not declared"),
        # a struct field changes type, or the fields change order
        ("    int n, k;           /* W is [n, k] */", "    int64_t n, k;", "struct cb_lin_t"),
        ("    float eps, scale;", "    float scale, eps;", "struct cb_model_t"),
        # a format is renumbered
        ("CB_FMT_Q4_1 = 3", "CB_FMT_Q4_1 = 5", "CB_FMT_Q4_1: cb_cpu.h has 5"),
    ],
    ids=["arg-type", "arg-added", "return-type", "unbound-export", "undeclared-binding", "struct-field",
         "struct-order", "format-number"],
)
def test_a_drifted_header_is_refused(old: str, new: str, complaint: str) -> None:
    with pytest.raises(abi.AbiMismatch, match=complaint):
        abi.check(_mutated(old, new))


@needs_cc
def test_loading_against_a_drifted_header_or_table_fails(
    kernels: CpuKernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = tmp_path / "cb_cpu.h"
    header.write_text(_mutated("cb_silu_mul_f32(const float *x, int64_t ldx, int m, int inter,",
                               "cb_silu_mul_f32(const float *x, int64_t ldx, int m, float inter,"))
    with pytest.raises(abi.AbiMismatch, match="cb_silu_mul_f32"):
        CpuKernels(kernels.path, header)
    # the other side: the Python table drifts from the (unchanged) header
    restype, argtypes = abi.FUNCTIONS["cb_linear"]
    monkeypatch.setitem(abi.FUNCTIONS, "cb_linear", (restype, argtypes[:-1]))
    with pytest.raises(abi.AbiMismatch, match="cb_linear"):
        CpuKernels(kernels.path)


@needs_cc
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm on this machine")
def test_every_exported_symbol_is_declared_and_bound(kernels: CpuKernels) -> None:
    listing = subprocess.run(["nm", "-D", "--defined-only", str(kernels.path)], capture_output=True, text=True,
                             check=True).stdout
    exported = {m.group(1) for m in re.finditer(r"^\S+\s+T\s+(\w+)$", listing, flags=re.M)}
    assert exported == set(abi.parse_header(HEADER_TEXT).functions) == set(abi.FUNCTIONS)


def test_the_library_name_covers_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src_dir = tmp_path / "csrc"
    shutil.copytree(cpu_native.SOURCE_DIR, src_dir)
    monkeypatch.setattr(cpu_native, "SOURCE_DIR", src_dir)
    assert {p.name for p in cpu_native.sources()} >= {"cb_cpu.h", "cb_simd.h", "panels.h", "layers.c"}
    before = cpu_native._library_path("cc", ("-O3",))
    (src_dir / "cb_cpu.h").write_text(HEADER_TEXT + "\n/* edited */\n")
    assert cpu_native._library_path("cc", ("-O3",)) != before
