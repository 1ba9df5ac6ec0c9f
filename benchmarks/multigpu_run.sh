#!/usr/bin/env bash
# The multi-GPU run (dp2 x tp2 x pp2 on 8 GPUs; tp2 x pp2 on 4; pp2 on 2), as one prepared command.
#
#   device call, kind nvidia-h200-x8, carry [".whl"]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site && bash benchmarks/multigpu_run.sh
#
# Writes everything under $OUT as one tarball (the device returns at most 8 files):
#   1. the trainer with the agent, 1F1B and interleaved 1F1B, inductor, bf16, TORCH_NCCL_ENABLE_TIMING=1:
#      every rank's /metrics scraped mid-run, run summaries, OTLP-JSON traces, event logs;
#   2. step time with the agent on/off and NCCL timing on/off, interleaved (benchmarks/overhead.py);
#   3. the fault matrix on NCCL (hpar-agent diagnose --all with the GPU layout).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
RES=$(mktemp -d)/multigpu
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# NVLink multicast stays off on these shared hosts (device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 \
  || { echo "pip install of hpar-agent failed"; exit 1; }
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
case "$NGPU" in
  8) LAYOUT=(--dp 2 --tp 2 --pp 2) ;;
  4|5|6|7) NGPU=4; LAYOUT=(--dp 1 --tp 2 --pp 2) ;;
  *) NGPU=2; LAYOUT=(--dp 1 --tp 1 --pp 2) ;;
esac
MODEL=(--compile inductor --dtype bf16 --layers 8 --dim 2048 --heads 16 --seq-len 1024 --global-batch 32 --vocab 8192)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "layout ${LAYOUT[*]} on $NGPU GPUs"; } > "$RES/machine.txt" 2>&1

scrape_all() {  # $1: base port, $2: file prefix
  for r in $(seq 0 $((NGPU - 1))); do curl -s "http://127.0.0.1:$(($1 + r))/metrics" > "$2.rank$r.txt"; done
}

for sched in 1f1b interleaved-1f1b; do
  dir="$RES/run-$sched"
  mkdir -p "$dir"
  HPAR_RUN_DIR="$dir" HPAR_JOB_ID="multigpu-$sched" HPAR_METRICS_PORT=19470 HPAR_TRACE_EVERY=5 \
  TORCH_NCCL_ENABLE_TIMING=1 \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m hpar_trainer \
      "${LAYOUT[@]}" "${MODEL[@]}" --schedule "$sched" --microbatches 8 --steps 60 --log-every 10 \
      --out "$dir/trainer.json" > "$dir/torchrun.log" 2>&1 &
  pid=$!
  sleep 90; scrape_all 19470 "$dir/scrape"  # after compile, mid-run
  wait $pid; echo "$sched exit $?" >> "$RES/machine.txt"
done

# agent on/off (+ A/A control) in blocks of one job; then NCCL timing on/off, which needs a process per run
python3 benchmarks/overhead.py --config gpu --nproc "$NGPU" --extra "${LAYOUT[*]} ${MODEL[*]} --schedule 1f1b --microbatches 8" \
  --aa --no-profiler --pairs "${PAIRS:-20}" --json "$RES/overhead-blocks.json" > "$RES/overhead-blocks.log" 2>&1
python3 benchmarks/overhead.py --config gpu --nproc "$NGPU" --extra "${LAYOUT[*]} ${MODEL[*]} --schedule 1f1b --microbatches 8" \
  --design runs --no-profiler --pairs 5 --json "$RES/overhead-runs.json" > "$RES/overhead-runs.log" 2>&1

python3 -m hpar_agent.cli diagnose --all --nproc "$NGPU" --run-dir "$RES/matrix" --timeout 400 \
  -- "${LAYOUT[@]}" --device cuda --dtype bf16 > "$RES/matrix.log" 2>&1

tar -czf "$OUT/multigpu.tar.gz" -C "$(dirname "$RES")" multigpu
tail -n 30 "$RES/matrix.log"
