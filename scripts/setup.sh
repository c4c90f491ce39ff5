#!/usr/bin/env bash
# Create .venv in the checkout and install specserve with its test extras.
# CPU machines get torch==2.13.0 (the CPU build on local disk) first; a machine with an
# NVIDIA driver keeps whatever CUDA torch pip resolves (or the user's, if already in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.specserve-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch
  else
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
fi
# deepspeed's setup.py imports torch: build it against the torch already in the venv.
.venv/bin/python -m pip install -q --no-build-isolation "deepspeed>=0.16"
.venv/bin/python -m pip install -q -e ".[test]"
touch "$stamp"
