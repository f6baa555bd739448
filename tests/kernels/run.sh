#!/usr/bin/env bash
# The kernels under AddressSanitizer and UndefinedBehaviorSanitizer, on this x86-64 machine:
# - the kernel driver (driver.cpp: every ISA this CPU supports against the scalar kernel, bit for
#   bit, at sizes around every vector width and the 8-bit block, every dtype layout, option set and
#   special value, misaligned, in guard zones) built with GCC and with Clang, each with
#   -fsanitize=address,undefined -fno-sanitize-recover=all and the project's flags;
# - the steps the driver writes for the device kernel's tests (--write-steps), under the same checks;
# - the libFuzzer targets, from the seeds that seeds.py writes, for a fixed time: fuzz_adam.cpp
#   (each ISA against scalar on calls decoded from the input) and fuzz_overlap.cpp
#   (csrc/memory_overlap.cpp against a brute-force enumeration of addresses).
# Exits non-zero on any failure; a failing fuzz input is printed in hex, and kept in FUZZ_ARTIFACTS
# when that is set.
#
# Needs (Debian): clang-16 libclang-rt-16-dev g++; .ci/run installs them. Override the tools with
# CLANGXX and HOST_CXX; FUZZ_SECONDS (default 36) is the fuzzing time, two thirds of it on the
# kernels and one third on the overlap check; KERNEL_JOBS (default 2) compiles in parallel.
set -euo pipefail
cd "$(dirname "$0")/../.."

clangxx=${CLANGXX:-clang++-16}
host_cxx=${HOST_CXX:-g++}
fuzz_seconds=${FUZZ_SECONDS:-36}
jobs=${KERNEL_JOBS:-2}
for tool in "$clangxx" "$host_cxx" python3; do
  if ! command -v "$tool" > /dev/null; then
    echo "tests/kernels/run.sh: $tool not found; on Debian: apt-get install clang-16 libclang-rt-16-dev g++" >&2
    exit 1
  fi
done
case "$(uname -m)" in
  x86_64) ;;
  *) echo "tests/kernels/run.sh: runs the x86-64 kernels; the AArch64 ones are tested by tests/arm/run.sh" >&2
    exit 1 ;;
esac

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=tests/kernels/build_flags.sh
source tests/kernels/build_flags.sh
sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g)
common=(-std=c++17 "${flags[@]}" "${sanitize[@]}" -Wall -Wextra -Werror -Icsrc)
# The kernels for Clang carry libFuzzer's coverage hooks; its driver links the same objects.
# GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on themselves.
builds=(
  "gcc|$host_cxx -Wno-maybe-uninitialized"
  "clang|$clangxx -fsanitize=fuzzer-no-link"
)
compile_jobs=()
for build in "${builds[@]}"; do
  name=${build%%|*}
  mkdir -p "$work/$name"
  for src in "${sources[@]}"; do
    compile_jobs+=("${build#*|} ${common[*]} -c $src -o $work/$name/$(echo "$src" | tr / _).o")
  done
done
printf '%s\n' "${compile_jobs[@]}" | xargs -P "$jobs" -I{} sh -c '{}'
link_jobs=(
  "$host_cxx -Wno-maybe-uninitialized ${common[*]} tests/kernels/driver.cpp $work/gcc/*.o -o $work/driver-gcc"
  "$clangxx -fsanitize=fuzzer-no-link ${common[*]} tests/kernels/driver.cpp $work/clang/*.o -o $work/driver-clang"
  "$clangxx -fsanitize=fuzzer ${common[*]} tests/kernels/fuzz_adam.cpp $work/clang/*.o -o $work/fuzz-adam"
  "$clangxx -fsanitize=fuzzer ${common[*]} tests/kernels/fuzz_overlap.cpp $work/clang/*.o -o $work/fuzz-overlap"
)
printf '%s\n' "${link_jobs[@]}" | xargs -P "$jobs" -I{} sh -c '{}'
python3 tests/kernels/seeds.py "$work/seeds"
echo "built in $((SECONDS - start)) s"

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
    tail -n 60 "$work/out" | sed 's/^/     /'
  fi
}

# GCC puts 64-byte-aligned AVX-512 locals on ASan's fake stack (use after return) 32-byte-aligned, and
# its aligned stores to them fault: that check runs on the Clang build only.
asan=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
check "gcc, ASan+UBSan: every ISA against scalar" env ASAN_OPTIONS=$asan=0 "$work/driver-gcc"
check "clang, ASan+UBSan: every ISA against scalar" env ASAN_OPTIONS=$asan=1 "$work/driver-clang"
grep -E "supported|cases bitwise" "$work/out" | sed 's/^/     /' || true
check "clang, ASan+UBSan: the device kernel's steps written (--write-steps)" env ASAN_OPTIONS=$asan=1 \
  "$work/driver-clang" --write-steps "$work/steps.bin"
export ASAN_OPTIONS=$asan=1

# libFuzzer: new inputs go to a scratch corpus, the seeds are read only. A crash leaves its input
# in the artifacts directory and its hex on the log.
artifacts=${FUZZ_ARTIFACTS:-$work/artifacts}
mkdir -p "$artifacts"
fuzz() {  # target, seconds
  mkdir -p "$work/corpus-$1"
  "$work/fuzz-$1" -max_total_time="$2" -timeout=20 -print_final_stats=1 -artifact_prefix="$artifacts/$1-" \
    "$work/corpus-$1" "$work/seeds/$1"
}
adam_seconds=$((fuzz_seconds * 2 / 3))
for target in adam overlap; do
  seconds=$adam_seconds
  [ "$target" = overlap ] && seconds=$((fuzz_seconds - adam_seconds))
  check "fuzz_$target, ${seconds} s" fuzz "$target" "$seconds"
  grep -E "^#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::new_units_added" "$work/out" | sed 's/^/     /' || true
  for crash in "$artifacts/$target"-*; do
    [ -e "$crash" ] || continue
    echo "     input $crash:"
    od -An -tx1 -v "$crash" | sed 's/^/     /'
  done
done

echo "kernels step took $((SECONDS - start)) s"
echo "kernels: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
