#!/usr/bin/env bash
# The GPU check, for a machine with CUDA: the `gpu` tests, then the GPU benchmarks, JSON under
# bench_results/. Sized to finish in under 8 minutes on one H100/H200-class GPU.
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
# 1. the CUDA backend's tests (bit-identical gradients, pinned pool, streams)
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/runtime 2>&1 | tee "$out/gpu_tests.txt" || status=1
# 2. runtime cost on CUDA: hook overhead, nothing-evicted overhead, policies at 30-80%
timeout 120 python scripts/bench_runtime.py --backend cuda --model gpt --size medium --steps 8 --rounds 20 \
    --out "$out/runtime_cuda.json" || status=1
# 3. sim-to-real on CUDA (calibrated link, every policy)
timeout 120 python scripts/bench_sim2real.py --backend cuda --rounds 3 --steps 2 --out "$out/sim2real_cuda.json" || status=1
# 4. side by side on a ~350M-parameter GPT at 50% and 30%: the learned policy, capuchin, swap-all,
#    save_on_cpu(pin_memory=True) and full activation checkpointing, against plain training
for b in 50% 30%; do
  timeout 100 python -m swapsched.cli run gpt --size 350m --batch-size 4 --seq-len 512 --budget "$b" --steps 6 \
      --backend cuda --compare --compare-policies capuchin,swap-all --no-progress \
      --json "$out/gpt350m_${b%\%}.json" || status=1
done
echo "gpu_check: exit $status; results in $out/"
exit $status
