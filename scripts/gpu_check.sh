#!/usr/bin/env bash
# GPU check: on a machine with CUDA, run the decode step against the roofline with
# FlexAttention and with the gather + SDPA fallback (scripts/gpu_roofline.py), TP = 2 on the one
# GPU against TP = 1 (scripts/gpu_tp_check.py) and the engine's CUDA tests; then, in what is
# left of 8 minutes, the start-up graph warm-up, the roofline with 64-token blocks and
# `specserve bench engine --device cuda`. Every stage has its own timeout and logs to $OUT (if set)
# or ./gpu-check-out. A failing stage is reported and the next one still runs; the exit status
# is the number of failed stages.
#
#   PYTHON=python3        interpreter with torch (CUDA) and transformers (default: python3)
#   FAMILY=path           model family (target/, draft/); default: shared/models/reference-py if
#                         present, else ./demo-family if complete, else a demo family trained
#                         here for ~150 s (models build-demo --device cuda), else a random tiny one
#   DTYPE=bfloat16        bench dtype (default bfloat16)
#   DRY_RUN=1             every stage on CPU with tiny models (the environment stage fails: no
#                         CUDA), to find a script's error before a GPU's minutes are spent
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
set -x
PY=${PYTHON:-python3}
DTYPE=${DTYPE:-bfloat16}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
FAILED=0
DEV=cuda
if [ "${DRY_RUN:-}" = 1 ]; then DEV=cpu; export DEVICE=cpu DRY_RUN; fi
stage() { echo; echo "=== stage: $* ($(date -u +%T))"; }
fail() { echo "!!! stage failed: $*"; FAILED=$((FAILED + 1)); }

stage "environment"
nvidia-smi || true
timeout 30 "$PY" - <<'EOF' || fail environment
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__)
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(0), torch.cuda.mem_get_info())
for lib in ("flashinfer", "flash_attn"):
    try:
        __import__(lib); print(lib, "importable")
    except ImportError:
        print(lib, "absent (torch SDPA fallback)")
EOF

stage "decode step against the roofline (8B-shaped target, 1B-shaped draft, bf16; flex with CUDA graphs, flex, then sdpa)"
timeout 230 "$PY" scripts/gpu_roofline.py || fail "roofline"

stage "TP = 2 on this one GPU (gloo) against TP = 1"
timeout 100 "$PY" scripts/gpu_tp_check.py || fail "tp check"

stage "CUDA tests (pytest -m gpu)"
if timeout 20 "$PY" -c "import pytest" 2>/dev/null; then
    timeout 80 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu.py \
        --junitxml="$OUT/gpu-tests.xml" || fail "gpu tests"
else
    echo "pytest is not installed for $PY: running the same checks without it"
    timeout 80 "$PY" scripts/gpu_tests_nopytest.py || fail "gpu tests (no pytest)"
fi

# With time left inside the 8 minutes: what capturing every graph bucket at start costs
# (graph_warmup, off by default until this is measured: decision 0039), then the other side of
# the block-size trade (decision 0037).
if [ "$SECONDS" -lt 330 ]; then
    stage "CUDA graphs warmed up at start (8B-shaped target and its draft, max_num_seqs 128)"
    WARMUP=1 timeout 120 "$PY" scripts/gpu_roofline.py || fail "graph warm-up"
fi
if [ "$SECONDS" -lt 390 ]; then
    stage "roofline with 64-token blocks (FlexAttention with CUDA graphs only)"
    BLOCK_SIZE=64 ATTENTION=flex+graphs timeout $((470 - SECONDS)) "$PY" scripts/gpu_roofline.py \
        || fail "roofline, 64-token blocks"
fi

stage "model family"
FAM=${FAMILY:-}
if [ -z "$FAM" ] && [ -f shared/models/reference-py/target/config.json ]; then
    FAM=shared/models/reference-py
fi
if [ -z "$FAM" ] && [ -f demo-family/target/config.json ] && [ -f demo-family/draft/config.json ]; then
    FAM=demo-family
fi
if [ -z "$FAM" ]; then
    timeout 200 "$PY" -m cluster models build-demo --device cuda --steps-scale 0.5 \
        --out "$ROOT/gpu-demo-family" && FAM=$ROOT/gpu-demo-family || fail "build-demo"
fi
if [ -z "$FAM" ]; then
    timeout 150 "$PY" -c "
import sys; sys.path.insert(0, 'tests')
from tiny_models import make_family
make_family('$ROOT/gpu-tiny-family')" && FAM=$ROOT/gpu-tiny-family || fail "tiny family"
fi
echo "family: $FAM"

stage "bench engine --device $DEV ($DTYPE)"
if [ -n "$FAM" ] && [ "$SECONDS" -lt 430 ]; then    # what time is left, up to 8 minutes
    timeout $((470 - SECONDS)) "$PY" -m cluster bench engine --family "$FAM" --device "$DEV" --dtype "$DTYPE" \
        --threads 2 --prompts 3 --new-tokens 128 --k-max 6 --batches 1,4,16,32,64 \
        --json "$OUT/bench-cuda-$DTYPE.json" || fail "bench engine"
fi

stage "done: $FAILED failed stage(s)"
exit "$FAILED"
