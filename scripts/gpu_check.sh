#!/usr/bin/env bash
# The GPU check, for a machine with CUDA: the `gpu` tests, then the GPU benchmarks, JSON under
# bench_results/. Each step has its own time limit (8 minutes in all, within the 8 it must fit in
# on one H100/H200-class GPU), and bench_results/gpu_check.json records every step's exit status
# and seconds even when one fails or times out (exit 124).
#   bash scripts/gpu_check.sh
# Needs a CUDA build of torch and swapsched installed (README, "GPU users"); makes no downloads.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench_results
mkdir -p "$out"
python - <<'PY' || { echo "no CUDA device: nothing to check here"; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
python -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)" | tee "$out/gpu_device.txt"
status=0
steps=()
# step NAME LIMIT_S COMMAND...: run with its own time limit, log to $out/NAME.txt, record the result
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  tail -5 "$out/$name.txt"
  steps+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}")
  echo "[$name] exit $rc in $((SECONDS - t0)) s (limit $limit s)"
  [ "$rc" -eq 0 ] || status=1
}
# 1. the CUDA backend's tests (bit-identical gradients, pinned pool, streams, the budget on CUDA)
step gpu_tests 110 python -m pytest -m gpu -q -p no:cacheprovider tests/runtime tests/compiled
# 2. runtime cost on CUDA: hook overhead, nothing-evicted overhead, policies at 30-80%
step runtime_cuda 60 python scripts/bench_runtime.py --backend cuda --model gpt --size medium --steps 8 --rounds 10 \
    --out "$out/runtime_cuda.json"
# 3. sim-to-real on CUDA (calibrates the link first, then every policy)
step sim2real_cuda 70 python scripts/bench_sim2real.py --backend cuda --rounds 3 --steps 2 --out "$out/sim2real_cuda.json"
# 4. side by side on a ~350M-parameter GPT at 50%, interleaved: the learned planner, capuchin, the peers
#    (checkpointing, selective checkpointing, save_on_cpu(pin_memory=True), checkpoint-offload), peaks by max_memory_allocated
step gpt350m_50 100 python -m swapsched.cli run gpt --size 350m --batch-size 4 --seq-len 512 --budget 50% --steps 6 \
    --backend cuda --compare --compare-policies capuchin --rounds 4 --no-progress --json "$out/gpt350m_50.json"
# 5. the compiled executor (R10) on the same GPT at 50%: step time and max_memory_allocated beside
#    the hook runtime, torch.compile with activation_memory_budget=0.5 and SAC (torch's default op list)
step compiled_gpt350m_50 80 python scripts/check_compiled_gpu.py --budget 50% --steps 4 --out "$out/compiled_gpu.json"
# 6. the whole training state moved on CUDA (R17): a GPT with AdamW at half its static bytes plus its
#    activation floor, default against the offloaders' placements; pinned host masters, copy streams
step state_live_cuda 60 python scripts/bench_state_live.py --backend cuda --size large --rounds 2 --round-steps 3 \
    --out "$out/state_live_cuda.json"
joined=$(IFS=,; echo "${steps[*]}")
echo "{\"exit\": $status, \"steps\": [$joined]}" > "$out/gpu_check.json"
echo "gpu_check: exit $status; results in $out/ (summary: $out/gpu_check.json)"
exit $status
