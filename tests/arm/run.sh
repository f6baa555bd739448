#!/usr/bin/env bash
# The ARM kernels, tested on an x86-64 machine (emulated, not timed):
# - every torch-free source in cpu_adam/_build.py compiled for AArch64 with GCC and Clang, -Werror,
#   with the project's flags, and no fused multiply-add in any kernel but the one the source writes;
# - the kernel driver (tests/kernels/driver.cpp) built for x86-64 writes the scalar kernel's
#   results, then each AArch64 build runs under qemu-aarch64 at SVE vector lengths of 128, 256, 512
#   and 2048 bits: every ARM ISA against the ARM scalar kernel, and the ARM scalar kernel against the
#   x86 one;
# - run-time detection under CPU models without SVE or BF16, CPU_ADAM_ISA, and the AArch64 build
#   without Linux's auxiliary vector (as on macOS), which has NEON only;
# - the device kernel's fixture, tests/arm/aarch64_steps.bin (tests/test_device_kernel_arm.py): the
#   AArch64 scalar kernel's steps (driver --write-steps), every ARM ISA agreeing on them, rewritten
#   by each compiler's build and equal to the committed file byte for byte. UPDATE_STEPS=1 writes
#   the GCC build's file over the committed one instead (then commit it).
#
# Needs (Debian): g++-12-aarch64-linux-gnu clang-16 qemu-user; .ci/run installs them, and
# g++-11-aarch64-linux-gnu (Ubuntu 22.04's compiler), built and run at one vector length when present.
# Override the tools with ARM_GXX, ARM_GXX_OLD, ARM_CLANGXX, HOST_CXX, QEMU. Jobs: ARM_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."

arm_gxx=${ARM_GXX:-aarch64-linux-gnu-g++-12}
arm_gxx_old=${ARM_GXX_OLD:-aarch64-linux-gnu-g++-11}
arm_clangxx=${ARM_CLANGXX:-clang++-16}
host_cxx=${HOST_CXX:-g++}
qemu=${QEMU:-qemu-aarch64}
objdump=${ARM_OBJDUMP:-aarch64-linux-gnu-objdump}
jobs=${ARM_JOBS:-2}
for tool in "$arm_gxx" "$arm_clangxx" "$host_cxx" "$qemu" "$objdump"; do
  if ! command -v "$tool" > /dev/null; then
    echo "tests/arm/run.sh: $tool not found; on Debian: apt-get install g++-12-aarch64-linux-gnu clang-16 qemu-user" >&2
    exit 1
  fi
done

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=tests/kernels/build_flags.sh
source tests/kernels/build_flags.sh
sources+=(tests/kernels/driver.cpp)
common=(-std=c++17 "${flags[@]}" -Wall -Wextra -Werror -Icsrc)

# name|compiler and its flags; GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on themselves.
builds=(
  "x86|$host_cxx -Wno-maybe-uninitialized"
  "gcc|$arm_gxx"
  "clang|$arm_clangxx --target=aarch64-linux-gnu"
  "nolinux|$arm_clangxx --target=aarch64-linux-gnu -U__linux__"
)
if command -v "$arm_gxx_old" > /dev/null; then builds+=("gcc-old|$arm_gxx_old"); fi
compile_jobs=()
for build in "${builds[@]}"; do
  name=${build%%|*}
  mkdir -p "$work/$name"
  for src in "${sources[@]}"; do
    obj="$work/$name/$(echo "$src" | tr / _).o"
    compile_jobs+=("${build#*|} ${common[*]} -c $src -o $obj")
  done
done
printf '%s\n' "${compile_jobs[@]}" | xargs -P "$jobs" -I{} sh -c '{}'
for build in "${builds[@]}"; do
  name=${build%%|*}
  read -r -a compiler <<< "${build#*|}"
  static=(-static)
  [ "$name" = x86 ] && static=()
  "${compiler[@]}" "${static[@]}" "$work/$name"/*.o -o "$work/driver-$name"
done
echo "built in $((SECONDS - start)) s: ${builds[*]}"

passed=0
failed=0
check() {  # description, then the command; its output is shown when it fails
  local what=$1
  shift
  if "$@" > "$work/out" 2>&1; then
    passed=$((passed + 1))
    echo "ok   $what"
  else
    failed=$((failed + 1))
    echo "FAIL $what"
    sed 's/^/     /' "$work/out"
  fi
}

# -ffp-contract=off is what keeps scalar and vector results identical: no kernel may fuse what the
# source does not. The kernels fuse one multiply-add on purpose (Adam's L2 term, rounded once as
# torch rounds it); compiled with CPU_ADAM_CHECK_NO_FUSION it is kept apart, and none may be left.
no_fma() {  # compiler and its flags
  local fused objects=()
  mkdir -p "$work/nofusion"
  for src in csrc/kernels/*.cpp; do
    objects+=("$work/nofusion/$(basename "$src" .cpp).o")
    "$@" "${common[@]}" -DCPU_ADAM_CHECK_NO_FUSION -c "$src" -o "${objects[-1]}"
  done
  fused=$("$objdump" -d "${objects[@]}" | grep -cE $'\t(fmla|fmls|fmadd|fmsub|fnmadd|fnmsub|fmad|fmsb|fnmla|fnmls|bfmlal[bt]?)\t' || true)
  rm -rf "$work/nofusion"
  echo "fused multiply-adds: $fused"
  [ "$fused" -eq 0 ]
}
check "gcc: no fused multiply-add in the kernels but the one written" no_fma "$arm_gxx"
check "clang: no fused multiply-add in the kernels but the one written" no_fma "$arm_clangxx" --target=aarch64-linux-gnu

check "x86-64: ISAs against scalar, reference written" "$work/driver-x86" --write-reference "$work/x86.ref"
grep -E "supported|cases bitwise|flush edge" "$work/out" | sed 's/^/     /'

# One qemu run per compiler and vector length; two at a time.
all_isas=sve_bf16,sve,neon_bf16,neon,scalar
runs=()
for name in gcc clang; do
  for bits in 128 256 512 2048; do
    runs+=("$name $bits")
  done
done
if [ -x "$work/driver-gcc-old" ]; then runs+=("gcc-old 512"); fi
run_one() {  # compiler name, SVE bits
  "$qemu" -cpu "max,sve$2=on,sve-default-vector-length=$(($2 / 8))" "$work/driver-$1" \
    --check-reference "$work/x86.ref" --expect-sve-bits "$2" --expect-isas "$all_isas" --expect-active sve_bf16 \
    > "$work/run-$1-$2" 2>&1
}
export -f run_one
export qemu work all_isas
printf '%s\n' "${runs[@]}" | xargs -P "$jobs" -L 1 bash -c 'run_one "$0" "$1" || true'
for run in "${runs[@]}"; do
  set -- $run
  check "$1 build, SVE $2 bits: every ISA against scalar, scalar against x86-64" \
    grep -q "passed, 0 failed" "$work/run-$1-$2"
  if [ "$2" = 128 ]; then grep -E "cases bitwise|cases differ|flush edge" "$work/run-$1-$2" | sed 's/^/     /'; fi
  grep -q "passed, 0 failed" "$work/run-$1-$2" || sed 's/^/     /' "$work/run-$1-$2"
done

steps=tests/arm/aarch64_steps.bin
write_steps() {  # compiler name
  "$qemu" -cpu max "$work/driver-$1" --write-steps "$work/steps-$1.bin" --expect-isas "$all_isas" || return 1
  if [ "${UPDATE_STEPS:-0}" = 1 ] && [ "$1" = gcc ]; then cp "$work/steps-$1.bin" "$steps"; fi
  if ! cmp "$work/steps-$1.bin" "$steps"; then
    echo "the steps differ from $steps; if the kernel or the cases changed on purpose, rewrite it:"
    echo "UPDATE_STEPS=1 bash tests/arm/run.sh, and commit it"
    return 1
  fi
}
for name in gcc clang; do
  check "$name build: the steps of tests/test_device_kernel_arm.py written, every ISA agreeing, as committed" \
    write_steps "$name"
done

# Detection: what each CPU model offers, best first; CPU_ADAM_ISA picks or refuses.
detect() {  # qemu CPU, then driver arguments
  local cpu=$1
  shift
  "$qemu" -cpu "$cpu" "$work/driver-gcc" --detect-only "$@"
}
check "detection: SVE off, BF16 on" detect max,sve=off --expect-isas neon_bf16,neon,scalar --expect-active neon_bf16
check "detection: Neoverse N1 (no SVE, no BF16)" detect neoverse-n1 --expect-isas neon,scalar --expect-active neon
check "detection: A64FX (SVE, no BF16)" detect a64fx --expect-isas sve,neon,scalar --expect-active sve
check "CPU_ADAM_ISA=neon picks neon" env CPU_ADAM_ISA=neon "$qemu" -cpu max "$work/driver-gcc" --detect-only \
  --expect-active neon
check "CPU_ADAM_ISA=sve is refused without SVE" env CPU_ADAM_ISA=sve "$qemu" -cpu neoverse-n1 "$work/driver-gcc" \
  --detect-only --expect-active error
check "AArch64 without Linux (as macOS): NEON only, every case against scalar" \
  "$qemu" -cpu max "$work/driver-nolinux" --expect-isas neon,scalar --expect-active neon

echo "ARM step took $((SECONDS - start)) s"
echo "arm: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
