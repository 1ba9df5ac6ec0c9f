#!/usr/bin/env bash
# The one device call: GPU validation, then the GPU overhead benchmark (results under $OUT).
# The device call's command installs the carried wheels to /tmp/site first (see BENCHMARKS.md).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 \
  || { echo "pip install of hpar-agent failed"; exit 1; }
python3 -c "import hpar_agent, hpar_trainer, opentelemetry.sdk, torch; print('imports ok', torch.__version__)" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/machine.txt"
python3 benchmarks/gpu_validate.py --json "$OUT/gpu-validate.json" 2>&1 | grep -v '^20..-..-.. .*hpar_trainer' \
  | tee "$OUT/gpu-validate.log"
python3 benchmarks/overhead.py --config gpu --pairs "${PAIRS:-5}" --json "$OUT/overhead-gpu.json" 2>&1 \
  | grep -v '^20..-..-.. .*hpar_trainer' | tee "$OUT/overhead-gpu.log"
