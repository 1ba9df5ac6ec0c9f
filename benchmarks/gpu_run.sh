#!/usr/bin/env bash
# Device calls: GPU validation, the overhead benchmark (GPU config, and the CPU config on the device's
# quiet cores), the component costs and the CPU rank timelines; results under $OUT. Pick parts with RUN
# (default: all but the timelines):
#   RUN="overhead-gpu components-gpu" bash benchmarks/gpu_run.sh
#   RUN="reader cpu-timeline" bash benchmarks/gpu_run.sh   # full FR reads in the reader process
#   RUN=cpu-threads [SAMPLED=1] bash benchmarks/gpu_run.sh  # CPU: CPU a second by thread, the reads' too (~2 min; +1 with HPAR_FR_COMPLETE=0)
#   RUN=cpu-reads bash benchmarks/gpu_run.sh                # CPU beside a reference: on, and full reads at slots only (~9 min)
#   RUN=cpu-ablation bash benchmarks/gpu_run.sh             # CPU: training thread vs passes (~8 min)
#   RUN=cpu-overhead bash benchmarks/gpu_run.sh             # CPU: pass cost by component, blocks on/off (~9 min)
#   RUN=cpu-pace bash benchmarks/gpu_run.sh                 # CPU pinned: blocks, passes sliced finer/coarser (~9 min)
#   RUN=cpu-ref bash benchmarks/gpu_run.sh                  # CPU: blocks beside a reference job on the other cores (~9 min; MAX_S=450)
#   RUN=cpu-split bash benchmarks/gpu_run.sh                # CPU beside a reference: on, hooks only, GIL slices alone (~9 min)
#   RUN=cpu-switch bash benchmarks/gpu_run.sh               # the same with the switch interval lowered while slices wait (~9 min)
#   RUN=cpu-long bash benchmarks/gpu_run.sh                 # CPU: 60-step blocks, ratios by steps since attach (~9 min)
#   RUN=cpu-twin-blocks bash benchmarks/gpu_run.sh          # CPU: twin jobs on the core halves, blocks in lockstep (~9 min)
#   RUN=cpu-twin-runs bash benchmarks/gpu_run.sh            # CPU: twin fresh jobs a slot, attached at start (~9 min)
#   RUN=cpu-twin-spin [SPIN=50/2000[/idle]] bash benchmarks/gpu_run.sh  # CPU: twin blocks, on against the reads' CPU alone (~9 min)
#   RUN=gpu-blocks bash benchmarks/gpu_run.sh               # one GPU, blocks (~9 min)
#   RUN=gpu-runs bash benchmarks/gpu_run.sh                 # one GPU, separate runs (~9 min)
#   RUN=gpu-detail bash benchmarks/gpu_run.sh               # one GPU, a fast loop's phases, every k-th step vs every step (~2 min)
#   RUN=fr-turnover bash benchmarks/gpu_run.sh              # one GPU, NCCL: reads at the ring's turnover lose nothing (~1 min)
# The device call's command installs the carried wheels to /tmp/site first (see BENCHMARKS.md).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
RUN=${RUN:-"validate overhead-gpu overhead-cpu components-gpu"}
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 \
  || { echo "pip install of hpar-agent failed"; exit 1; }
python3 -c "import hpar_agent, hpar_trainer, opentelemetry.sdk, torch; print('imports ok', torch.__version__)" || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "cpus $(nproc)"; lscpu | grep -E '^(Model name|Thread|Core|Socket|NUMA)'
  echo "siblings: $(cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | sort -un | tr '\n' ' ')"
  } | tee "$OUT/machine.txt"
quiet() { grep -v -e '^20..-..-.. .*hpar_trainer' -e '^USDT' -e 'profiler_st'; }
for part in $RUN; do
  case "$part" in
    validate) python3 -m benchmarks.gpu_validate --json "$OUT/gpu-validate.json" 2>&1 | quiet | tee "$OUT/gpu-validate.log" ;;
    overhead-gpu) python3 -m benchmarks.overhead --config gpu --json "$OUT/overhead-gpu.json" 2>&1 | quiet \
      | tee "$OUT/overhead-gpu.log" | tail -n 8 ;;
    overhead-cpu) CUDA_VISIBLE_DEVICES= python3 -m benchmarks.overhead --config cpu --json "$OUT/overhead-cpu.json" 2>&1 \
      | quiet | tee "$OUT/overhead-cpu.log" | tail -n 8 ;;
    components-gpu)  # one script per component cost, as the single components.py ran them
      python3 -m benchmarks.hook_cost --steps 10000 --blocks 20 --json "$OUT/hook-cost-gpu.json" 2>&1 | quiet \
        | tee "$OUT/hook-cost-gpu.log" | tail -n 10
      for b in agent_cpu metrics_render agent_rss span_export; do
        python3 -m "benchmarks.$b" --device cuda --json "$OUT/$b-gpu.json" 2>&1 | quiet | tee "$OUT/$b-gpu.log" | tail -n 20
      done ;;
    reader) TORCH_NCCL_ENABLE_TIMING=1 python3 -m benchmarks.gpu_validate --skip collectives nvml cuda_leak \
      trainer_leak trainer binding --json "$OUT/reader.json" 2>&1 | quiet | tee "$OUT/reader.log" ;;
    cpu-timeline)  # 4 CPU ranks: reads in the reader process (auto on these cores), off, reads inline
      CUDA_VISIBLE_DEVICES= python3 -m benchmarks.rank_timeline --steps 300 --arm on --arm off \
        --json "$OUT/rank-timeline.json" 2>&1 | quiet | tee "$OUT/rank-timeline.log"
      CUDA_VISIBLE_DEVICES= python3 -m benchmarks.rank_timeline --steps 300 --arm on --env HPAR_FR_READER=inline \
        --json "$OUT/rank-timeline-inline.json" 2>&1 | quiet | tee "$OUT/rank-timeline-inline.log" ;;
    cpu-threads)  # 4 CPU ranks, on and off: CPU a second by thread (the worker server's dumps, the reader process)
      CUDA_VISIBLE_DEVICES= timeout 200 python3 -m benchmarks.rank_timeline --steps 250 --arm on --arm off \
        --json "$OUT/rank-threads.json" 2>&1 | quiet | tee "$OUT/rank-threads.log" | grep -v "agent-thread CPU per pass"
      if [ -n "${SAMPLED:-}" ]; then CUDA_VISIBLE_DEVICES= timeout 120 python3 -m benchmarks.rank_timeline --steps 250 \
        --arm on --env HPAR_FR_COMPLETE=0 --json "$OUT/rank-threads-sampled.json" 2>&1 | quiet \
        | tee "$OUT/rank-threads-sampled.log" | grep -v "agent-thread CPU per pass"; fi ;;
    cpu-long-steps)  # 4 CPU ranks on 8 cores (a twin job's half): steps 12 ms over their median, against what overlapped them
      longsteps() {  # TAG, then rank_timeline's arguments
        local tag=$1; shift
        CUDA_VISIBLE_DEVICES= timeout 150 taskset -c 0-7 python3 -m benchmarks.rank_timeline --steps 500 --skip 40 \
          --long-ms 12 "$@" --raw "$RAW/$tag.json" --json "$OUT/long-steps-$tag.json" 2>&1 | quiet | grep -v "agent-thread CPU per pass" \
          | cut -c1-1500 | tee "$OUT/long-steps-$tag.log"
      }
      RAW=$(mktemp -d)
      longsteps on-off --arm on --arm off
      longsteps slots --arm on --env HPAR_FR_COMPLETE=0
      longsteps hooks --arm on --env HPAR_INTERVAL=3600 --env HPAR_FR_INTERVAL=86400
      tar czf "$OUT/long-steps-raw.tgz" -C "$RAW" . ;;
    cpu-reads)  # beside a reference: the agent, and the agent with full reads at fr_interval slots only
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-450} + 110)) python3 -m benchmarks.overhead --config cpu --design blocks \
        --aa --no-profiler --pairs 120 --max-s "${MAX_S:-450}" --block 30 --reference \
        --variant sampled:HPAR_FR_COMPLETE=0 --json "$OUT/overhead-cpu-reads.json" 2>&1 \
        | quiet | tee "$OUT/overhead-cpu-reads.log" | tail -n 22 ;;
    cpu-ablation)  # 4 CPU ranks: where the cost is (training thread vs agent passes), then blocks with a no-pass arm
      CUDA_VISIBLE_DEVICES= python3 -m benchmarks.rank_timeline --steps 300 --arm on --arm off --py-spy 100:15:1000 \
        --json "$OUT/rank-timeline.json" 2>&1 | quiet | tee "$OUT/rank-timeline.log" | cut -c1-600
      CUDA_VISIBLE_DEVICES= timeout 330 python3 -m benchmarks.overhead --config cpu --design blocks --aa --no-profiler \
        --pairs 80 --max-s 280 --block 30 --variant nopass:HPAR_INTERVAL=3600,HPAR_FR_INTERVAL=86400 \
        --json "$OUT/overhead-cpu-ablation.json" 2>&1 | quiet | tee "$OUT/overhead-cpu-ablation.log" | tail -n 8 ;;
    cpu-overhead)  # 4 CPU ranks: the pass's cost by component, then blocks on/off with an A/A control
      CUDA_VISIBLE_DEVICES= python3 -m benchmarks.rank_timeline --steps 300 --arm on --arm off \
        --json "$OUT/rank-timeline.json" 2>&1 | quiet | tee "$OUT/rank-timeline.log" | cut -c1-900
      CUDA_VISIBLE_DEVICES= timeout 360 python3 -m benchmarks.overhead --config cpu --design blocks --aa --no-profiler \
        --pairs 120 --max-s 320 --block 30 --json "$OUT/overhead-cpu-blocks.json" 2>&1 | quiet \
        | tee "$OUT/overhead-cpu-blocks.log" | tail -n 8 ;;
    cpu-ref)  # 4 CPU ranks on half the cores, a reference job of 4 more on the other half: machine-wide drift cancels
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-450} + 110)) python3 -m benchmarks.overhead --config cpu --design blocks \
        --aa --no-profiler --pairs 120 --max-s "${MAX_S:-450}" --block 30 --reference --windows 3:10,10:30 --json "$OUT/overhead-cpu-ref.json" 2>&1 \
        | quiet | tee "$OUT/overhead-cpu-ref.log" | tail -n 16 ;;
    cpu-split)  # where the CPU cost is: the agent, its hooks alone (no passes), a bare 1 ms / 100 ms GIL burner
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-450} + 110)) python3 -m benchmarks.overhead --config cpu --design blocks \
        --aa --no-profiler --pairs 120 --max-s "${MAX_S:-450}" --block 30 --reference --burn 1/100 \
        --variant nopass:HPAR_INTERVAL=3600,HPAR_FR_INTERVAL=86400 --json "$OUT/overhead-cpu-split.json" 2>&1 \
        | quiet | tee "$OUT/overhead-cpu-split.log" | tail -n 22 ;;
    cpu-switch)  # whether slices that start late are the cost (locally, DTensor ops delay a wake 0.3-1 ms either way)
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-450} + 110)) python3 -m benchmarks.overhead --config cpu --design blocks \
        --aa --no-profiler --pairs 120 --max-s "${MAX_S:-450}" --block 30 --reference --burn 1/100/0.1 \
        --variant switch:HPAR_BENCH_SWITCH=0.1 --json "$OUT/overhead-cpu-switch.json" 2>&1 \
        | quiet | tee "$OUT/overhead-cpu-switch.log" | tail -n 22 ;;
    cpu-long)  # 4 CPU ranks: long blocks, the ratio on the steps soon after attach and on the later ones
      CUDA_VISIBLE_DEVICES= timeout 560 python3 -m benchmarks.overhead --config cpu --design blocks --aa --no-profiler \
        --pairs 120 --max-s 470 --block 60 --windows 3:15,15:30,30:60 --json "$OUT/overhead-cpu-long.json" 2>&1 \
        | quiet | tee "$OUT/overhead-cpu-long.log" | tail -n 14 ;;
    cpu-pace)  # 4 CPU ranks pinned to 4 cores each: blocks on/off/A-A and the passes sliced finer and coarser
      CUDA_VISIBLE_DEVICES= timeout 560 python3 -m benchmarks.overhead --config cpu --design blocks --aa --no-profiler \
        --pairs 120 --max-s 500 --block 30 --pin 4 --variant fine:HPAR_BENCH_PACE=0.25/25 \
        --variant coarse:HPAR_BENCH_PACE=4/400 --json "$OUT/overhead-cpu-pace.json" 2>&1 | quiet \
        | tee "$OUT/overhead-cpu-pace.log" | tail -n 10 ;;
    cpu-twin-blocks)  # two 4-rank jobs on the two core halves, agent on one, blocks in lockstep (benchmarks/twin.py)
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-420} + 130)) python3 -m benchmarks.twin --design blocks --block 60 \
        --windows 3:22,25:60 --aa --max-s "${MAX_S:-420}" ${TWIN_EXTRA:-} --json "$OUT/twin-blocks.json" 2>&1 | quiet \
        | tee "$OUT/twin-blocks.log" | grep -v '^\[block' | tail -n 24 ;;
    cpu-twin-spin)  # twin blocks: the agent, and a rank thread busy off the GIL as a full read's dump is (overhead.cpu_spinner)
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-400} + 130)) python3 -m benchmarks.twin --design blocks --block 60 \
        --windows 3:22,25:60 --aa --spin "${SPIN:-50/2000}" --max-s "${MAX_S:-400}" ${TWIN_EXTRA:-} \
        --json "$OUT/twin-spin.json" 2>&1 | quiet | tee "$OUT/twin-spin.log" | grep -v '^\[block' | tail -n 30 ;;
    cpu-twin-runs)  # two fresh 4-rank jobs a slot, agent attached at start on one, halves swapped (what users get)
      CUDA_VISIBLE_DEVICES= timeout $((${MAX_S:-450} + 100)) python3 -m benchmarks.twin --design runs --steps 200 \
        --skip 30 --max-s "${MAX_S:-450}" ${TWIN_EXTRA:-} --json "$OUT/twin-runs.json" 2>&1 | quiet \
        | tee "$OUT/twin-runs.log" | tail -n 30 ;;
    gpu-blocks)  # one GPU, blocks (attach and detach in one process): the view that resolves a sub-percent cost
      timeout 540 python3 -m benchmarks.overhead --config gpu --design blocks --aa --no-profiler --pairs 200 \
        --max-s 440 --windows 5:15,15:30 --json "$OUT/overhead-gpu-blocks.json" 2>&1 | quiet | tee "$OUT/overhead-gpu-blocks.log" | tail -n 12 ;;
    gpu-runs)  # one GPU, a fresh process per run, the agent attached before the first step (what users get)
      timeout 520 python3 -m benchmarks.overhead --config gpu --design runs --no-profiler --steps 50 --skip 10 \
        --pairs 14 --max-s 450 --json "$OUT/overhead-gpu-runs.json" 2>&1 | quiet | tee "$OUT/overhead-gpu-runs.log" | tail -n 8 ;;
    gpu-detail)  # one GPU, a small model's fast loop: phases with every k-th step detailed, and with every step
      for rate in 10 0; do
        HPAR_DETAIL_RATE=$rate HPAR_RUN_DIR="$OUT/detail-$rate" HPAR_METRICS_PORT=-1 timeout 150 python3 -m hpar_trainer \
          --device cuda --layers 2 --dim 256 --heads 4 --seq-len 64 --global-batch 8 --steps 600 --log-every 200 2>&1 \
          | quiet | tail -n 2
        python3 -c "import json,sys; s=json.load(open(sys.argv[1])); c=s['components']; print('HPAR_DETAIL_RATE=$rate',
          'stride', c['steps']['detail_stride'], 'steps', c['steps']['steps'], 'anatomy', c['anatomy']['clock'],
          {k: round(v * 1e3, 3) for k, v in c['anatomy']['phase_seconds_p50'].items()}, 'ms; errors', s['errors'])" \
          "$OUT/detail-$rate/summary.rank0.json" | tee -a "$OUT/gpu-detail.log"
      done ;;
    fr-turnover)  # one GPU, NCCL: every all-reduce counted and timed through reads at the ring's turnover
      for ring in ${RINGS:-2000 1000}; do
        timeout 120 python3 -m benchmarks.fr_turnover --device cuda --ring $ring --rate 2000 --seconds "${SECONDS_FR:-20}" \
          --json "$OUT/fr-turnover-$ring.json" 2>&1 | quiet | grep -v WorkerServer | tail -n 3
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
