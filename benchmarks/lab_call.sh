#!/bin/bash
# One call of the 16-core lab (../shared/tools/spark-bundle: source /tmp/sn/env.sh first), its runs in order of
# what the open issues need most, each skipped when the call's budget has not the seconds it needs, each cut at
# the budget's end; what each wrote comes back under $OUT (8 files at most):
#
#   bash benchmarks/lab_call.sh 520      # seconds this call may use
#
#   machine.txt   cores, GPU, torch, the load before the first run
#   t99_k8.*      time_to_99.py, K = 8: one process with 1 and 8 threads, both engines, TorchDistributor, 8 bare
#   gpu.*         gpu_workers.py: LeNet two workers sharing the GPU against one GPU process; AlexNet images/s
#   t99_k16.*     time_to_99.py, K = 16: both engines, TorchDistributor, 16 bare processes (as time allows)
#   lab.log       what was skipped, and each step's exit status
set -u
budget=${1:-520}; t0=$SECONDS
out=${OUT:-benchmarks/results/lab}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - t0))); }
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  echo "load before: $(cat /proc/loadavg)"; } > "$out/machine.txt" 2>&1
step() {  # NAME SECONDS_NEEDED COMMAND...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "skip $name: $(left) s left, $need needed" | tee -a "$out/lab.log"; return; fi
  timeout -k 5 "$(left)" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? at $((SECONDS - t0)) s" | tee -a "$out/lab.log"
}
step t99_k8 240 python3 benchmarks/time_to_99.py --workers 8 --threads 1,8 --eval-budget 0.05 --timeout 150 \
  --out "$out/t99_k8.json"
step gpu 60 python3 benchmarks/gpu_workers.py --only lenet,alexnet --timeout-s 120 --out "$out/gpu.json"
step t99_k16 150 python3 benchmarks/time_to_99.py --workers 16 --threads 1 --only 16 --eval-budget 0.05 \
  --timeout 120 --out "$out/t99_k16.json"
echo "done at $((SECONDS - t0)) s" | tee -a "$out/lab.log"
