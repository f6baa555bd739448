#!/usr/bin/env bash
# Everything a session lent a GPU measures, in one call of about 9 minutes: each stage has its own time limit
# and writes its log and JSON as it ends, so a stage cut short leaves the others' results; all of it goes back
# as $OUT/gpu_check.tgz, with the tables in $OUT/summary.txt (the device tool returns 8 files at most).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on the device machine
#
# torchao travels as a wheel in .whl (the device tool's notes say how): it is installed first where present.
# Stages, in the order of their value:
#   1. the CUDA tests: the device kernel bitwise on CUDA (every layout, 8-bit, stochastic rounding), the
#      offload optimizer's CUDA paths;
#   2. 1.32B, clipping at 1.0: GPU AdamW, torchao, and cpu_adam's configs, host-only and with the device's share
#      ("auto", and 1.0 where it fits), with one step's timeline each for bench_replay.py;
#   3. the same without clipping, overlap="backward" against the share;
#   4. 6.66B (--layers 32 --dim 4096 --heads 32 --batch 4): all-host against "auto", and torchao;
#   5. FSDP2 with CPUOffloadPolicy at 1.32B: CPUAdam against torch's AdamW.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
WORK=/tmp/gpu_check
mkdir -p "$WORK"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; \
  git log --oneline -1; } > "$WORK/machine.txt" 2>&1

stage() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most $seconds s)"
  local start=$SECONDS
  timeout "$seconds" "$@" > "$WORK/$name.log" 2>&1
  echo "   exit $?, $((SECONDS - start)) s"
}

bench=(python3 benchmarks/bench_gpu_offload.py --quiet --warmup 2 --steps 3 --split-steps 1 --timeout 120)
stage tests 110 python3 -m pytest -q -x tests/test_device_kernel.py tests/test_offload_cuda.py \
  tests/test_offload_8bit.py tests/test_offload_overlap.py -k "cuda or device"
stage clip1 190 "${bench[@]}" --max-grad-norm 1.0 --json "$WORK/clip1.json" --record-timeline "$WORK/timelines" \
  --contenders torch_adamw,torchao,cpu_adam:sr/bf16,cpu_adam:sr/bf16/share=auto,cpu_adam:sr/bf16/share=1,cpu_adam:fp32/bf16/share=auto,cpu_adam:fp32/fp32/share=auto,cpu_adam:sr/8bit/share=auto
stage noclip 80 "${bench[@]}" --max-grad-norm none --json "$WORK/noclip.json" \
  --contenders cpu_adam:sr/bf16/bwd,cpu_adam:sr/bf16/share=auto
stage big 110 "${bench[@]}" --layers 32 --dim 4096 --heads 32 --batch 4 --json "$WORK/big.json" \
  --contenders torchao,cpu_adam:sr/bf16,cpu_adam:sr/bf16/share=auto
stage fsdp2 60 "${bench[@]}" --json "$WORK/fsdp2.json" --contenders fsdp2_adamw,fsdp2_cpu_adam
tail -n 25 "$WORK"/*.log > "$OUT/summary.txt"
tar czf "$OUT/gpu_check.tgz" -C /tmp gpu_check
cat "$OUT/summary.txt"
