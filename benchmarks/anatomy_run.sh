#!/usr/bin/env bash
# Device call for the step anatomy: the hook cost on the device's quiet CPU cores, the CUDA-event phases
# of a 1-rank bf16 trainer run (clean, and with --inject slow-data), compare on the two, and the CPU
# overhead benchmark (the anatomy is on by default, so its "agent on" arm includes it). Results in $OUT.
# The device call carries .whl/ (the wheels torch's image lacks) and installs them to /tmp/site first.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
RUNS=/tmp/anatomy-runs
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site .whl/*.whl . >/dev/null 2>&1 \
  || { echo "pip install failed"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"
  echo "cpus $(nproc)"; } | tee "$OUT/machine.txt"
CUDA_VISIBLE_DEVICES= python3 -m benchmarks.hook_cost --steps 40000 --blocks 20 --json "$OUT/hook-cost.json"
# The command BENCHMARKS.md's "Step anatomy on CUDA" table states.
ARGS="--device cuda --compile inductor --dtype bf16 --layers 4 --dim 1024 --heads 8 --seq-len 512 --global-batch 8 --vocab 8192 --steps 150"
for name in clean slow-data; do
  extra=""
  [ "$name" = slow-data ] && extra="--inject slow-data --inject-delay 0.05"
  HPAR_RUN_DIR=$RUNS/$name HPAR_METRICS_PORT=-1 HPAR_TRACES=none torchrun --nproc-per-node 1 -m hpar_trainer $ARGS $extra --log-every 100 \
    --out "$RUNS/$name/trainer.json" > "$RUNS/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$RUNS/$name.log"; }
  python3 -c "import json,sys; a=json.load(open(sys.argv[1]))['components']['anatomy']; print(sys.argv[2], json.dumps(a))" \
    "$RUNS/$name/summary.rank0.json" "$name" | tee -a "$OUT/anatomy-gpu.txt"
done
hpar-agent compare "$RUNS/clean" "$RUNS/slow-data" | tee -a "$OUT/anatomy-gpu.txt"
CUDA_VISIBLE_DEVICES= python3 -m benchmarks.overhead --config cpu --pairs 10 --no-profiler --json "$OUT/overhead-cpu.json" 2>&1 \
  | grep -v -e '^20..-..-.. .*hpar_trainer' | tail -n 8
