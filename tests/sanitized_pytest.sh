#!/usr/bin/env bash
# Builds swapio._C with AddressSanitizer + UBSan into build/asan (without the per-ISA SIMD kernels, which
# tests/native/run.sh --sanitize runs at every level) and runs the Python tests that drive the native core
# against it (libasan preloaded into the interpreter; leak checking is left to the native
# programs in tests/native, since CPython and torch keep memory alive at exit by design).
# Usage: tests/sanitized_pytest.sh [pytest args...]   (default: the I/O, store and kernel tests)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/build/asan
.ci/install-build-requires  # setup.py below imports pybind11
SWAPIO_SCALAR_ONLY=1 SWAPIO_EXTRA_CFLAGS="-O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  python setup.py -q build_ext --build-lib "$out/lib" --build-temp "$out/tmp" >/dev/null
rm -rf "$out/pkg" && mkdir -p "$out/pkg"
cp -r swapio "$out/pkg/" && rm -f "$out"/pkg/swapio/_C*.so && cp "$out"/lib/swapio/_C*.so "$out/pkg/swapio/"
if [[ $# == 0 ]]; then
  set -- tests/io/test_roundtrip.py tests/io/test_concurrency.py tests/io/test_io_errors.py tests/io/test_swapstore.py \
    tests/io/test_pinned.py tests/kernels/test_adam_kernel.py
fi
args=()
for a in "$@"; do [[ -e "$a" ]] && args+=("$root/$a") || args+=("$a"); done
cd "$out"  # so `import swapio` finds the sanitized copy, not the source tree
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
PYTHONPATH="$out/pkg" python -m pytest -q -p no:cacheprovider "${args[@]}"
