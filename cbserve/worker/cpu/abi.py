"""The ctypes side of the C kernels' ABI, checked against its one header, ``csrc/cb_cpu.h``, at load.

``FUNCTIONS`` and the ``Structure`` classes below are what the Python wrappers (``kernels.py``) are written
against; ``bind`` parses the header's ``CB_API`` prototypes, structs and enums and raises ``AbiMismatch``
naming every difference (a function missing on either side, an argument or field of another type, a
format or return code numbered differently) before it sets any ``argtypes``. So a C signature that changes
without its binding is an error when the library loads, never a stray memory access at a call. The library
exports exactly the header's functions (it is built with ``-fvisibility=hidden``; see ``native.py``).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "cb_cpu.h"

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
CType = type[ctypes._SimpleCData] | type[ctypes.Structure]


class LinearArgs(ctypes.Structure):
    """cb_lin_t: one packed linear layer."""

    _fields_ = [("fmt", _I32), ("w", _P), ("n", _I32), ("k", _I32), ("bias", _P), ("bias_in_kernel", _I32),
                ("split", _I32), ("rest", _P)]


class LayerArgs(ctypes.Structure):
    """cb_layer_t: one decoder layer's weights and KV cache."""

    _fields_ = [("in_norm", _P), ("post_norm", _P), ("qkv", LinearArgs), ("o", LinearArgs),
                ("gate_up", LinearArgs), ("down", LinearArgs), ("k_cache", _P), ("v_cache", _P),
                ("window", _I32), ("q_norm", _P), ("k_norm", _P), ("pre_ff_norm", _P), ("post_ff_norm", _P),
                ("softcap", _F32), ("cos", _P), ("sin", _P)]


class ModelArgs(ctypes.Structure):
    """cb_model_t: the shapes every layer shares."""

    _fields_ = [("num_layers", _I32), ("hidden", _I32), ("heads", _I32), ("kv_heads", _I32), ("head_dim", _I32),
                ("inter", _I32), ("num_blocks", _I32), ("block_size", _I32), ("eps", _F32), ("scale", _F32),
                ("cos", _P), ("sin", _P), ("max_pos", _I64), ("act", _I32)]


STRUCTS: dict[str, type[ctypes.Structure]] = {"cb_lin_t": LinearArgs, "cb_layer_t": LayerArgs, "cb_model_t": ModelArgs}

# name -> (restype, argtypes). Pointers of any type (structs and arrays of them included) are c_void_p.
FUNCTIONS: dict[str, tuple[CType, list[CType]]] = {
    "cb_isa_features": (_I32, []),
    "cb_packed_bytes": (_I64, [_I32, _I32, _I32]),
    "cb_gemm_panel_width": (_I32, []),
    "cb_pack_weight_f32": (_I32, [_P, _I64, _I32, _I32, _P]),
    "cb_pack_weight_bf16": (_I32, [_P, _I64, _I32, _I32, _P]),
    "cb_pack_weight_bf16_dot": (_I32, [_P, _I64, _I32, _I32, _P]),
    "cb_pack_q8_0": (_I32, [_P, _P, _I32, _I32, _P]),
    "cb_pack_q4_1": (_I32, [_P, _P, _P, _I32, _I32, _P]),
    "cb_pack_q4_0": (_I32, [_P, _P, _I32, _I32, _P]),
    "cb_pack_q4_k": (_I32, [_P, _P, _P, _P, _P, _I32, _I32, _P]),
    "cb_pack_q5_0": (_I32, [_P, _P, _I32, _I32, _P]),
    "cb_pack_q5_k": (_I32, [_P, _P, _P, _P, _P, _I32, _I32, _P]),
    "cb_pack_q6_k": (_I32, [_P, _P, _P, _I32, _I32, _P]),
    "cb_repack_i16": (_I32, [_I32, _P, _I32, _I32, _P]),
    "cb_unpack_panels": (_I32, [_I32, _P, _I32, _I32, _P, _I64]),
    "cb_linear": (_I32, [_I32, _P, _I64, _I32, _I32, _P, _I32, _P, _P, _I64]),
    "cb_set_amx": (_I32, [_I32]),
    "cb_set_rows": (_I32, [_I32]),
    "cb_add_rms_norm_f32": (_I32, [_P, _I64, _P, _I64, _P, _F32, _P, _I64, _I32, _I32]),
    "cb_silu_mul_f32": (_I32, [_P, _I64, _I32, _I32, _P, _I64]),
    "cb_gelu_tanh_mul_f32": (_I32, [_P, _I64, _I32, _I32, _P, _I64]),
    "cb_apply_token_bitmask_f32": (_I32, [_P, _I64, _I32, _I32, _P, _I64]),
    "cb_top_p_threshold_f32": (_I32, [_P, _I64, _I32, _I32, _P, _P]),
    "cb_argmax_f32": (_I32, [_P, _I64, _I32, _I32, _P]),
    "cb_rotary_f32": (_I32, [_P, _I64, _I32, _I32, _I32, _P, _P, _P, _I64]),
    "cb_paged_decode_f32": (_I32, [_P, _I64, _P, _I64, _P, _P, _I32, _P, _I64, _P, _I32, _I32, _I32, _I32, _I32,
                                   _F32, _I32, _I32, _F32]),
    "cb_llama_layers": (_I32, [_P, _P, _I32, _P, _P, _P, _P, _I64, _P, _I32]),
    "cb_lora_add_f32": (_I32, [_P, _I64, _P, _I64, _I32, _I32, _P, _P, _I32, _P, _I32]),
    "cb_lora_add_bf16": (_I32, [_P, _I64, _P, _I64, _I32, _I32, _P, _P, _I32, _P, _I32]),
}

# The header's enums that Python numbers too: return codes, the build's ISA bits and packed-weight formats.
RETURN_CODES = {"CB_OK": 0, "CB_ENOMEM": 1, "CB_EINVAL": 2, "CB_ERANGE": 3}
ISA_FEATURES = {"avx2": 1, "avx512": 2, "avx512_bf16": 4, "amx": 8, "i16_dot": 16}
PANEL_FORMATS = {"f32": 0, "bf16": 1, "q8_0": 2, "q4_1": 3, "bf16_dot": 4, "q8_0_bf16": 5, "q4_1_bf16": 6,
                 "q4_0": 7, "q4_0_bf16": 8, "q4_k": 9, "q6_k": 10, "q5_k": 11,
                 "q5_0": 12}
# Flags or'ed into a format's number: "i16", the few-row products of a 4-8-bit block format with the rows rounded to
# int16 (INT16_ROWS_FORMATS; its name is the format's with "_i16" after it: "q4_k_i16"); "i16all", the same layout
# with every step's rows rounded so ("q4_k_i16all").
FORMAT_FLAGS = {"i16": 256, "i16all": 256 | 512}
INT16_ROWS_FORMATS = ("q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k", "q8_0")


def format_code(fmt: str) -> int:
    """The C number of panel format ``fmt`` (its flags or'ed in); KeyError for a name the kernels do not have."""
    base, _, flag = fmt.rpartition("_")
    if flag in FORMAT_FLAGS and base in INT16_ROWS_FORMATS:
        return PANEL_FORMATS[base] | FORMAT_FLAGS[flag]
    return PANEL_FORMATS[fmt]

_ERRORS = {RETURN_CODES["CB_ENOMEM"]: "out of memory for the kernel's scratch buffers",
           RETURN_CODES["CB_EINVAL"]: "invalid shapes",
           RETURN_CODES["CB_ERANGE"]: "an index (sequence length, block id or position) outside its table"}


def raise_for(rc: int, what: str) -> None:
    """RuntimeError naming a kernel's failure when its return code ``rc`` is not CB_OK."""
    if rc != 0:
        raise RuntimeError(f"CPU kernel {what} failed: {_ERRORS.get(rc, f'error {rc}')}")


_SCALARS: dict[str, CType] = {"int": _I32, "int32_t": _I32, "int64_t": _I64, "float": _F32}


class AbiMismatch(RuntimeError):
    """The ctypes table and csrc/cb_cpu.h disagree."""


@dataclass(frozen=True)
class Header:
    """What cb_cpu.h declares, as ctypes types."""

    functions: dict[str, tuple[CType, list[CType]]]
    structs: dict[str, list[tuple[str, CType]]]
    enums: dict[str, int]


def _strip_comments(text: str) -> str:
    """The header without comments and preprocessor lines."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))
    return re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)


def _c_type(decl: str, structs: dict[str, type[ctypes.Structure]]) -> CType:
    """The ctypes type of one C type (``decl`` without its name): a pointer, a scalar or a known struct."""
    if "*" in decl:
        return _P
    base = " ".join(w for w in decl.split() if w != "const")
    if base in _SCALARS:
        return _SCALARS[base]
    if base in structs:
        return structs[base]
    raise AbiMismatch(f"cb_cpu.h uses the C type {base!r}, which abi.py does not map to ctypes")


def _params(params: str) -> list[CType]:
    params = " ".join(params.split())
    if params in ("", "void"):
        return []
    out = []
    for p in params.split(","):
        m = re.fullmatch(r"\s*(.*?[\s*])(\w+)\s*", p)
        if m is None:
            raise AbiMismatch(f"cannot read the parameter {p.strip()!r} in cb_cpu.h")
        out.append(_c_type(m.group(1), STRUCTS))
    return out


def _struct_fields(body: str) -> list[tuple[str, CType]]:
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"((?:const\s+)?\w+)\s*(.*)", decl, flags=re.S)
        if m is None:
            raise AbiMismatch(f"cannot read the struct field {decl!r} in cb_cpu.h")
        for name in m.group(2).split(","):
            stars, ident = re.fullmatch(r"\s*(\**)\s*(\w+)\s*", name).groups()  # type: ignore[union-attr]
            fields.append((ident, _c_type(m.group(1) + stars, STRUCTS)))
    return fields


def parse_header(text: str) -> Header:
    """The CB_API prototypes, typedef'd structs and enum constants of the header's text."""
    src = _strip_comments(text)
    functions = {
        name: (_c_type(ret, STRUCTS), _params(params))
        for ret, name, params in re.findall(r"\bCB_API\s+([\w\s*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", src)
    }
    structs = {name: _struct_fields(body) for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;",
                                                                        src, flags=re.S)}
    enums = {k: int(v) for k, v in re.findall(r"\b(CB_[A-Z0-9_]+)\s*=\s*(-?\d+)", src)}
    return Header(functions, structs, enums)


def _name(t: CType) -> str:
    return t.__name__


def _function_differences(header: Header) -> list[str]:
    problems = [f"{n}: exported by cb_cpu.h but not bound in abi.FUNCTIONS" for n in header.functions
                if n not in FUNCTIONS]
    problems += [f"{n}: bound in abi.FUNCTIONS but not declared CB_API in cb_cpu.h" for n in FUNCTIONS
                 if n not in header.functions]
    for name, (ret, args) in FUNCTIONS.items():
        if name in header.functions and header.functions[name] != (ret, args):
            h_ret, h_args = header.functions[name]
            problems.append(f"{name}: cb_cpu.h has {_name(h_ret)}({', '.join(map(_name, h_args))}), abi.FUNCTIONS "
                            f"{_name(ret)}({', '.join(map(_name, args))})")
    return problems


def _struct_and_enum_differences(header: Header) -> list[str]:
    problems = []
    for name, cls in STRUCTS.items():
        fields = [(f[0], f[1]) for f in cls._fields_]
        if header.structs.get(name) != fields:
            found = header.structs.get(name)
            problems.append(f"struct {name}: cb_cpu.h has {_fields_text(found)}, {cls.__name__} {_fields_text(fields)}")
    expected = RETURN_CODES | {f"CB_FMT_{k.upper()}": v for k, v in PANEL_FORMATS.items()}
    expected |= {f"CB_ISA_{k.upper()}": v for k, v in ISA_FEATURES.items()}
    expected |= {f"CB_FMT_{k.upper()}": v for k, v in FORMAT_FLAGS.items()}
    problems += [f"{k}: cb_cpu.h has {header.enums.get(k)}, abi.py {v}" for k, v in expected.items()
                 if header.enums.get(k) != v]
    return problems


def _fields_text(fields: list[tuple[str, CType]] | None) -> str:
    return "nothing" if fields is None else "{" + ", ".join(f"{_name(t)} {n}" for n, t in fields) + "}"


def check(header_text: str) -> None:
    """Raise AbiMismatch listing every difference between the header and this module's tables."""
    header = parse_header(header_text)
    problems = _function_differences(header) + _struct_and_enum_differences(header)
    if problems:
        raise AbiMismatch("the CPU kernels' ctypes binding does not match csrc/cb_cpu.h:\n  " + "\n  ".join(problems))


def bind(lib: ctypes.CDLL, header: Path = HEADER) -> None:
    """Check the tables against ``header``, then set every function's restype and argtypes on ``lib``."""
    check(header.read_text())
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
