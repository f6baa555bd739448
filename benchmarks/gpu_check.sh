#!/usr/bin/env bash
# Everything a session lent a GPU measures, in one call of about 9 minutes: each stage has its own time limit
# and writes its log and JSON as it ends, so a stage cut short leaves the others' results; all of it goes back
# as $OUT/gpu_check.tgz, with the tables in $OUT/summary.txt (the device tool returns 8 files at most).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on the device machine
#
# torchao travels as a wheel in .whl (the device tool's notes say how): it is installed first where present.
# Stages, in the order of their value:
#   1. probe: the device kernel's bits (benchmarks/gpu_probe.py, eight processes at once): the NaNs the GPU
#      writes, every layout against the host kernel (non-NaN and NaN-only differences apart), div_rn and sqrt_rn
#      over every binade, random keys equal to 1, the ARM rule compiled;
#   2. tests: the CUDA tests, every one run (no -x: one failure does not hide the rest);
#   3. clip1: 1.32B, clipping at 1.0: GPU AdamW, torchao, cpu_adam all-host, the device's share ("auto" and 1.0)
#      at buckets of 2^23 and 2^25 elements, with one step's timeline each for bench_replay.py;
#   4. fsdp2: FSDP2 with CPUOffloadPolicy at 1.32B: CPUAdam clipping inside its step or after torch's
#      clip_grad_norm_ (fp32 shards + bf16 moments, bf16-SR shards + bf16
#      and 8-bit moments) against torch's AdamW(fused=True) on fp32 shards;
#   5. big: 6.66B (--layers 32 --dim 4096 --heads 32 --batch 4): the share ("auto", 1.0) against torchao.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
WORK=/tmp/gpu_check
mkdir -p "$WORK/probe"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log --oneline -1; } \
  > "$WORK/machine.txt" 2>&1

stage() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most $seconds s)"
  local start=$SECONDS
  timeout "$seconds" "$@" > "$WORK/$name.log" 2>&1
  echo "   exit $?, $((SECONDS - start)) s"
}

probe_parts() {  # the C++ kernels build once, then eight parts run at once (timeout runs it through bash -c)
  python3 -c "from cpu_adam import ops; ops.supported_isas()"
  for k in 0 1 2 3 4 5 6 7; do
    python3 benchmarks/gpu_probe.py --part "$k/8" --json "$WORK/probe/part$k.json" > "$WORK/probe/part$k.log" 2>&1 &
  done
  wait
  python3 benchmarks/gpu_probe.py --summary "$WORK"/probe/part*.json
}
export -f probe_parts
export WORK

xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
bench=(python3 benchmarks/bench_gpu_offload.py --quiet --warmup 2 --steps 3 --split-steps 1)
stage probe 90 bash -c probe_parts
stage tests 70 python3 -m pytest -q $xdist -p no:cacheprovider tests/test_device_kernel.py tests/test_offload_cuda.py \
  tests/test_offload_8bit.py tests/test_offload_overlap.py tests/test_device_share.py -k cuda
stage clip1 150 "${bench[@]}" --timeout 60 --max-grad-norm 1.0 --json "$WORK/clip1.json" \
  --record-timeline "$WORK/timelines" --contenders torch_adamw,cpu_adam:sr/bf16/share=1,cpu_adam:sr/bf16/share=auto,\
cpu_adam:sr/bf16/share=1/bucket=25,cpu_adam:sr/bf16/share=auto/bucket=25,torchao,cpu_adam:sr/bf16
stage fsdp2 130 "${bench[@]}" --timeout 45 --json "$WORK/fsdp2.json" \
  --contenders fsdp2:adamw,fsdp2:sr/bf16/inside,fsdp2:sr/bf16,fsdp2:sr/8bit/inside,fsdp2:fp32/bf16/inside
stage big 120 "${bench[@]}" --timeout 60 --layers 32 --dim 4096 --heads 32 --batch 4 --json "$WORK/big.json" \
  --contenders cpu_adam:sr/bf16/share=auto,torchao,cpu_adam:sr/bf16/share=1/bucket=25
{ cat "$WORK/machine.txt"; for log in "$WORK"/*.log; do echo "== $log"; tail -n 30 "$log"; done; } > "$OUT/summary.txt"
tar czf "$OUT/gpu_check.tgz" -C /tmp gpu_check
cat "$OUT/summary.txt"
