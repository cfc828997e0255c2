#!/usr/bin/env bash
# What each stage of the int8 kernels costs on this CPU: builds benchmarks/native/lowp_stage_cost.cpp against the
# kernel as it is, then against copies of csrc/ with one stage of lowp_loops.h's pipelined loop taken out (the
# encode; the step), and prints ns per element of int8 Adam and Lion at each SIMD level this CPU has. Taking the
# encode out leaves the codes as they were, so the data stay the same from step to step and the figure is that
# of the rest of the loop. (Taking the decode out is not measured: the step then runs on garbage, and NaNs take
# the kernel's slow path.) About a minute on 2 cores.
# Usage: benchmarks/lowp_stage_cost.sh [elements]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-16384}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
levels=(avx2)
grep -q avx512f /proc/cpuinfo && levels+=(avx512)
build() {  # build NAME: the harness against $work/NAME/csrc
  local src=$work/$1/csrc flags="-DSWAPIO_HAVE_X86_KERNELS=1 -O3 -std=c++17 -I$work/$1/csrc"
  g++ $flags -mavx2 -mfma -mf16c -c "$src/adam/adam_avx2.cpp" -o "$work/$1/avx2.o" &
  g++ $flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -c "$src/adam/adam_avx512.cpp" -o "$work/$1/avx512.o"
  g++ $flags -c "$src/adam/quant.cpp" -o "$work/$1/quant.o"
  g++ $flags -c "$src/adam/adam_scalar.cpp" -o "$work/$1/scalar.o"
  g++ $flags -c benchmarks/native/lowp_stage_cost.cpp -o "$work/$1/bench.o"
  wait
  g++ "$work/$1"/*.o -o "$work/$1/bench" -lpthread
}
variant() {  # variant NAME 'the call of lowp_loops.h's whole-block loops to take out (every occurrence)'
  mkdir -p "$work/$1"
  cp -r csrc "$work/$1/csrc"
  if [[ -n "$2" ]]; then
    grep -qF "$2" "$work/$1/csrc/adam/lowp_loops.h" || { echo "lowp_loops.h has no line '$2'" >&2; exit 1; }
    python3 - "$work/$1/csrc/adam/lowp_loops.h" "$2" <<'PY'
import sys
path, line = sys.argv[1], sys.argv[2]
text = open(path).read()
open(path, "w").write(text.replace(line, "(void)0;"))
PY
  fi
  build "$1"
}
variant whole ""
variant no_encode "encode_stride(a, b_enc, j, se);"
variant no_step "step_vectors(a, b_stp, j, ss, mm, vm, bd);"
echo "ns per element, $n elements, 1 thread, thread CPU time, best of 25 ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
printf '%-8s %-6s %10s %10s %10s\n' level algo whole no_encode no_step
for lvl in "${levels[@]}"; do
  for algo in adam lion; do
    row=()
    for v in whole no_encode no_step; do
      row+=("$("$work/$v/bench" "$n" "$lvl" "$algo" | sed -E 's/.*: ([0-9.]+) ns.*/\1/')")
    done
    printf '%-8s %-6s %10s %10s %10s\n' "$lvl" "$algo" "${row[@]}"
  done
done
