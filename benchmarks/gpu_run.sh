#!/usr/bin/env bash
# The GPU host's checks, one mode or several; each leaves <mode>.json and <mode>.log under $OUT
# (plus machine.txt). Installs the carried wheels in .whl/ (if any) and the project into /tmp/site first.
#
#   bash benchmarks/gpu_run.sh blocks       # one GPU, blocks: >= 50 pairs and their A/A        (~7.5 min)
#   bash benchmarks/gpu_run.sh runs         # one GPU, fresh runs and their A/A: 7-9 pairs; twice, then --merge
#   bash benchmarks/gpu_run.sh short        # one GPU, the tiny GPT's ~10 ms steps, fresh runs   (~7.5 min)
#   bash benchmarks/gpu_run.sh short-blocks # the same in one process, blocks: >= 50 pairs        (~7 min)
#   bash benchmarks/gpu_run.sh short-bound  # the same blocks, a GPU-bound ~8 ms loop               (~4 min)
#   bash benchmarks/gpu_run.sh short-cpu    # the same blocks on one CPU thread of the host        (~7 min)
#   bash benchmarks/gpu_run.sh cpu-ranks    # 4 CPU ranks, twin blocks on the core halves         (~8 min)
#   bash benchmarks/gpu_run.sh components   # hook_cost and components.py on the GPU              (~6 min)
#   bash benchmarks/gpu_run.sh tests        # pytest tests/gpu (tests tests: twice, tests.log and tests-2.log) (~5 min)
#   bash benchmarks/gpu_run.sh gate         # compare_gate.py on the host's CPUs: 2 x 10 rounds at once (~8 min)
# MAX_S=seconds changes a mode's time budget; the pairs it asks for are more than fit, the budget ends it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
# One install: a second --target --upgrade install replaces /tmp/site/bin whole (py-spy would go)
wheels=$(ls .whl/*.whl 2>/dev/null)
# shellcheck disable=SC2086
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site \
  $wheels . >/dev/null || exit 1
command -v py-spy >/dev/null || echo "gpu_run.sh: py-spy is not on PATH: the stack evidence will be missing"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "cpus $(nproc)"; lscpu | grep -E '^(Model name|Thread|Core|Socket)'; } > "$OUT/machine.txt"
run() {  # MODE, then the command; its output to $OUT/MODE.log, the trainer's step lines left out
  local mode=$1; shift
  "$@" 2>&1 | grep --line-buffered -v -e ' hpar_trainer[.:]' | tee "$OUT/$mode.log" | tail -n 25
}
ov="python3 -m benchmarks.overhead"
for mode in "$@"; do
  case "$mode" in
    blocks) run blocks $ov --config gpu --design blocks --pairs 200 --max-s "${MAX_S:-380}" --json "$OUT/blocks.json" ;;
    runs) run runs $ov --config gpu --design runs --pairs 20 --max-s "${MAX_S:-450}" --json "$OUT/runs.json" ;;
    short) run short $ov --config short-gpu --pairs 40 --max-s "${MAX_S:-420}" --json "$OUT/short.json" ;;
    short-blocks) run short-blocks $ov --config short-gpu --design blocks --pairs 200 --max-s "${MAX_S:-380}" \
      --json "$OUT/short-blocks.json" ;;
    short-bound) run short-bound $ov --config short-gpu --design blocks --pairs 200 --max-s "${MAX_S:-200}" \
      --extra "--layers 2 --dim 1024 --heads 16" --json "$OUT/short-bound.json" ;;
    short-cpu) CUDA_VISIBLE_DEVICES= run short-cpu $ov --config short-cpu --design blocks --pairs 200 \
      --max-s "${MAX_S:-380}" --json "$OUT/short-cpu.json" ;;
    cpu-ranks) CUDA_VISIBLE_DEVICES= run cpu-ranks $ov --config cpu --twin --design blocks --block 60 --pairs 200 \
      --max-s "${MAX_S:-380}" --json "$OUT/cpu-ranks.json" ;;
    components)
      run hook-cost python3 -m benchmarks.hook_cost --device cuda --json "$OUT/hook-cost.json"
      run components python3 -m benchmarks.components --device cuda --json "$OUT/components.json" ;;
    gate)  # GATE_JOBS (2) invocations of 10 rounds side by side, each a 2-rank CPU job at a time
      for h in $(seq 1 "${GATE_JOBS:-2}"); do
        CUDA_VISIBLE_DEVICES= timeout "${GATE_S:-300}" python3 -m benchmarks.compare_gate --pairs 10 --steps 150 \
          --json "$OUT/gate$h.json" > "$OUT/gate$h.log" 2>&1 &
      done
      wait; tail -n 4 "$OUT"/gate?.log ;;
    tests)  # TESTS: the files, in order (default tests/gpu); a second pass writes tests-2.log, and so on
      n=1; name=tests; while [ -e "$OUT/$name.log" ]; do n=$((n + 1)); name=tests-$n; done
      # shellcheck disable=SC2086
      run "$name" python3 -m pytest ${TESTS:-tests/gpu} -v -p no:cacheprovider ;;
    *) echo "unknown mode $mode (blocks runs short short-blocks short-bound short-cpu cpu-ranks components tests gate)"; exit 2 ;;
  esac
done
