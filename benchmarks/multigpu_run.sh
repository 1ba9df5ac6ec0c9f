#!/usr/bin/env bash
# The multi-GPU run (dp2 x tp2 x pp2 on 8 GPUs; tp2 x pp2 on 4; pp2 on 2), in phases that each fit one
# device call (10 minutes); pick them with RUN (default: all, for a machine without that limit):
#
#   device call, kind nvidia-h200-x8, carry [".whl"]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site && RUN=train-1f1b bash benchmarks/multigpu_run.sh
#
# Phases, each leaving its own tarball under $OUT as soon as it ends (a later timeout loses nothing):
#   train-1f1b, train-interleaved  the trainer with the agent, inductor, bf16, TORCH_NCCL_ENABLE_TIMING=1:
#                                  every rank's /metrics once it passed step 30, summaries, traces, events;
#   overhead                       agent on/off and an A/A control in blocks of one job (overhead.py);
#   nccl-timing                    TORCH_NCCL_ENABLE_TIMING on/off, a job per run (overhead.py --design runs);
#   matrix                         the fault matrix on NCCL, the modes in MODES (default all; 4+ GPUs: the
#                                  matrix's own 4-rank layouts with --device cuda --dtype bf16).
# Every phase's exit status goes to status.txt; the script exits non-zero if any phase failed.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
RUN=${RUN:-"train-1f1b train-interleaved overhead nccl-timing matrix"}
RES=$(mktemp -d)
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# NVLink multicast stays off on these shared hosts (device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 \
  || { echo "pip install of hpar-agent failed"; exit 1; }
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
case "$NGPU" in
  8) LAYOUT=(--dp 2 --tp 2 --pp 2) ;;
  4|5|6|7) NGPU=4; LAYOUT=(--dp 1 --tp 2 --pp 2) ;;
  2|3) NGPU=2; LAYOUT=(--dp 1 --tp 1 --pp 2) ;;
  *) echo "needs 2+ GPUs, found $NGPU"; exit 1 ;;
esac
MODEL=(--compile inductor --dtype bf16 --layers 8 --dim 2048 --heads 16 --seq-len 1024 --global-batch 32 --vocab 8192)
TRAIN=("${LAYOUT[@]}" "${MODEL[@]}" --microbatches 8)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "layout ${LAYOUT[*]} on $NGPU GPUs"; } > "$OUT/machine.txt" 2>&1
failed=0
finish() {  # $1: phase, $2: its exit status; pack the phase's directory into $OUT
  echo "$1 exit $2" >> "$OUT/status.txt"
  [ "$2" -eq 0 ] || failed=1
  tar -czf "$OUT/$1.tar.gz" -C "$RES" "$1"
}

train() {  # $1: phase, $2: schedule
  local dir="$RES/$1" base=19470
  mkdir -p "$dir"
  HPAR_RUN_DIR="$dir" HPAR_JOB_ID="multigpu-$2" HPAR_METRICS_PORT=$base HPAR_METRICS_PORT_FALLBACK=0 \
  HPAR_TRACE_EVERY=5 TORCH_NCCL_ENABLE_TIMING=1 \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m hpar_trainer \
      "${TRAIN[@]}" --schedule "$2" --steps 60 --log-every 10 --out "$dir/trainer.json" > "$dir/torchrun.log" 2>&1 &
  local pid=$! r
  for r in $(seq 0 $((NGPU - 1))); do  # scrape each rank once it has passed step 30 (compile done)
    until curl -sf "http://127.0.0.1:$((base + r))/metrics" > "$dir/scrape.rank$r.txt" \
        && awk '/^hpar_steps_total/ { exit !($2 >= 30) }' "$dir/scrape.rank$r.txt"; do
      kill -0 $pid 2>/dev/null || break
      sleep 2
    done
  done
  wait $pid
}

for phase in $RUN; do
  mkdir -p "$RES/$phase"
  case "$phase" in
    train-1f1b) train "$phase" 1f1b ;;
    train-interleaved) train "$phase" interleaved-1f1b ;;
    overhead) python3 -m benchmarks.overhead --config gpu --nproc "$NGPU" --extra "${TRAIN[*]} --schedule 1f1b" \
        --aa --no-profiler --pairs "${PAIRS:-20}" --json "$RES/$phase/overhead.json" > "$RES/$phase/overhead.log" 2>&1 ;;
    nccl-timing) python3 -m benchmarks.overhead --config gpu --nproc "$NGPU" --extra "${TRAIN[*]} --schedule 1f1b" \
        --design runs --no-profiler --pairs 2 --json "$RES/$phase/overhead.json" > "$RES/$phase/overhead.log" 2>&1 ;;
    matrix)
      if [ "$NGPU" -lt 4 ]; then echo "the fault matrix needs 4 GPUs" > "$RES/$phase/matrix.log"; false
      else
        modes=()
        for m in ${MODES:-$(python3 -c "from hpar_trainer.scenarios import EXPECTED; print(*EXPECTED)")}; do
          modes+=(--inject "$m")
        done
        python3 -m hpar_agent.tools.cli diagnose "${modes[@]}" --nproc 4 --run-dir "$RES/$phase" --timeout 400 \
          -- --device cuda --dtype bf16 > "$RES/$phase/matrix.log" 2>&1
      fi ;;
    *) echo "unknown phase $phase"; false ;;
  esac
  finish "$phase" $?
done
cat "$OUT/status.txt"
exit $failed
