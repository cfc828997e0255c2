#!/usr/bin/env bash
# Builds the native core (no Python) with each test program and runs them, each under a time limit.
# Usage: tests/native/run.sh [--sanitize | --tsan] [PROGRAM...]
#   --sanitize: AddressSanitizer + UBSan + LeakSanitizer, every program; the per-ISA SIMD kernels under ASan
#           alone (UBSan's checks of integer arithmetic are the scalar level's, which shares their arithmetic
#           bit for bit and is built with both; with both, adam_avx512.cpp alone took 156 s to compile).
#   --tsan: ThreadSanitizer, only the programs whose point is concurrency (listed below, with why), against the
#           parts of the core they use: an instrumented build of the SIMD Adam kernels alone costs about a
#           minute and a half of CPU, and their only threads are their pool's, which pool.cpp drives directly.
#   PROGRAM...: only these programs (names without .cpp).
# A program whose first line is `// engines: A B ...` runs once per engine (`prog A`, ...); exit 77 is a skip,
# and the program's last line of output says why. Objects and programs compile $(nproc) at a time.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/../.."
# -g1: line tables are all a sanitizer's report uses; full debug info doubled the ASan compile of the SIMD kernels
flags=(-std=c++17 -O1 -g1 -Wall -Wextra -Wno-unused-parameter -pthread -Icsrc -Itests/native)
isa_only=()  # flags for the per-ISA kernel files only
out=build/native
core=(csrc/common/*.cpp csrc/io/*.cpp csrc/mem/*.cpp csrc/adam/*.cpp)  # all but csrc/python (pybind11)
programs=()
mode=${1:-}
if [[ "$mode" == --sanitize || "$mode" == --tsan ]]; then shift; fi
if [[ "$mode" == --sanitize ]]; then
  flags+=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  isa_only=(-fno-sanitize=undefined)
  out=build/native-sanitize
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
elif [[ "$mode" == --tsan ]]; then
  flags+=(-fsanitize=thread -fno-omit-frame-pointer)
  out=build/native-tsan
  # die_after_fork=0: fork.cpp starts threads in the child on purpose (new handles must work there).
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0
  # Where threads meet: fault_* (the fault engine's plan shared by the workers, errors and give-ups handed
  # to waiting callers), stress (4 callers x 3 workers on one handle), split (4 callers, 4 workers), lifetime
  # (a handle destroyed with work queued, requests outliving it), fork (threads across fork()), pool (the Adam
  # kernel's thread pool). The others drive one request at a time through the same hand-offs.
  programs=(fault_errors fault_reap fault_retries fork lifetime pool split stress)
  core=(csrc/common/*.cpp csrc/io/*.cpp csrc/mem/*.cpp csrc/adam/adam_pool.cpp)
  export SWAPIO_STRESS_SECONDS=${SWAPIO_STRESS_SECONDS:-1}  # stress.cpp runs for a time: 1 s of it here
fi
(( $# > 0 )) && programs=("$@")
(( ${#programs[@]} > 0 )) || programs=($(basename -s .cpp tests/native/*.cpp))
mkdir -p "$out"
x86=$([[ "$(uname -m)" == x86_64 ]] && echo 1 || echo 0)
isa_flags() {  # the per-ISA flags of csrc/isa_flags.txt, as setup.py reads them
  [[ $x86 == 1 ]] || return 0
  local suffix flags
  while read -r suffix flags; do
    [[ -z "$suffix" || "$suffix" == \#* ]] && continue
    if [[ "$1" == *"$suffix" ]]; then echo "${flags%%#*}"; return 0; fi
  done < csrc/isa_flags.txt
}
throttle() { while (( $(jobs -r | wc -l) >= $(nproc) )); do wait -n || true; done; }
# A compile that fails leaves no output behind (no stale object or program from an earlier run is used):
# its error is printed, and the link, or the program's run, fails.
objs=()
by_cost=()  # the per-ISA kernels, the longest compiles, first
for src in "${core[@]}"; do [[ -n "$(isa_flags "$src")" ]] && by_cost+=("$src"); done
for src in "${core[@]}"; do [[ -z "$(isa_flags "$src")" ]] && by_cost+=("$src"); done
for src in "${by_cost[@]}"; do
  obj="$out/$(echo "$src" | tr / _).o"
  rm -f "$obj"
  isa=$(isa_flags "$src")
  g++ "${flags[@]}" -DSWAPIO_HAVE_X86_KERNELS=$x86 $isa ${isa:+"${isa_only[@]}"} -c "$src" -o "$obj" &
  objs+=("$obj")
  throttle
done
wait
for obj in "${objs[@]}"; do [[ -f "$obj" ]] || { echo "native: $obj did not compile"; exit 1; }; done
for name in "${programs[@]}"; do
  rm -f "$out/$name"
  g++ "${flags[@]}" "tests/native/$name.cpp" "${objs[@]}" -o "$out/$name" &
  throttle
done
wait
pass=0 fail=0 skip=0
for name in "${programs[@]}"; do
  engines=$(sed -n '1s|^// engines: ||p' "tests/native/$name.cpp")
  for engine in ${engines:-""}; do
    label=$name${engine:+[$engine]}
    set +e
    timeout 120 "$out/$name" $engine >"$out/$label.log" 2>&1
    rc=$?
    set -e
    case $rc in
      0) pass=$((pass + 1)); echo "PASS $label $(tail -n 1 "$out/$label.log")" ;;
      77) skip=$((skip + 1)); echo "SKIP $label: $(tail -n 1 "$out/$label.log")" ;;
      *) fail=$((fail + 1)); echo "FAIL $label (exit $rc)"; cat "$out/$label.log" ;;
    esac
  done
done
echo "native: $pass passed, $fail failed, $skip skipped"
[[ $fail == 0 ]]
