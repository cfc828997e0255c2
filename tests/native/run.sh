#!/usr/bin/env bash
# Builds the native core (no Python) with each test program and runs them, each under a time limit.
# Usage: tests/native/run.sh [--sanitize | --tsan]
#   --sanitize: AddressSanitizer + UBSan + LeakSanitizer; --tsan: ThreadSanitizer.
# A program whose first line is `// engines: A B ...` runs once per engine (`prog A`, ...); exit 77 is a skip,
# and the program's last line of output says why.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/../.."
flags=(-std=c++17 -O1 -g -Wall -Wextra -Wno-unused-parameter -pthread -Icsrc -Itests/native)
out=build/native
if [[ "${1:-}" == "--sanitize" ]]; then
  flags+=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  out=build/native-sanitize
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
elif [[ "${1:-}" == "--tsan" ]]; then
  flags+=(-fsanitize=thread -fno-omit-frame-pointer)
  out=build/native-tsan
  # die_after_fork=0: fork.cpp starts threads in the child on purpose (new handles must work there).
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0
fi
mkdir -p "$out"
core=(csrc/common/*.cpp csrc/io/*.cpp csrc/mem/*.cpp csrc/adam/*.cpp)  # all but csrc/python (pybind11)
x86=$([[ "$(uname -m)" == x86_64 ]] && echo 1 || echo 0)
isa_flags() {  # the per-ISA flags of csrc/isa_flags.txt, as setup.py reads them
  [[ $x86 == 1 ]] || return 0
  local suffix flags
  while read -r suffix flags; do
    [[ -z "$suffix" || "$suffix" == \#* ]] && continue
    if [[ "$1" == *"$suffix" ]]; then echo "${flags%%#*}"; return 0; fi
  done < csrc/isa_flags.txt
}
objs=()
for src in "${core[@]}"; do
  obj="$out/$(echo "$src" | tr / _).o"
  g++ "${flags[@]}" -DSWAPIO_HAVE_X86_KERNELS=$x86 $(isa_flags "$src") -c "$src" -o "$obj" &
  objs+=("$obj")
  while (( $(jobs -r | wc -l) >= $(nproc) )); do wait -n; done
done
wait
pass=0 fail=0 skip=0
for test in tests/native/*.cpp; do
  name=$(basename "$test" .cpp)
  g++ "${flags[@]}" "$test" "${objs[@]}" -o "$out/$name"
  engines=$(sed -n '1s|^// engines: ||p' "$test")
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
