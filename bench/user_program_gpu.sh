#!/usr/bin/env bash
# The PyTorch example (examples/torch-train) through the command contract on soft slices of this
# machine's GPU: planned against measured peak memory and the per-subjob overhead, as JSON (last
# line). Needs an NVIDIA driver and a CUDA build of torch; the repository's .venv for SJA itself
# (`make .venv/.installed`). Takes about two minutes.
#
#   bench/user_program_gpu.sh                          # torch in .venv
#   SJA_TORCH_PYTHON=/opt/torch/bin/python bench/user_program_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SJA_PYTHON:-.venv/bin/python}
TORCH_PY=${SJA_TORCH_PYTHON:-$PY}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
"$TORCH_PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch has no CUDA here')"
exec timeout 540 "$PY" bench/user_program.py --python "$TORCH_PY" --steps 3000 --width 4096 \
  --shares 0.125,0.25,0.5 --window-s 30 --json
