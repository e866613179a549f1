#!/usr/bin/env bash
# Runs the test suite (or the pytest arguments given) against torch_autobatch._C
# built with AddressSanitizer (setup.py's ASAN=1), in a copy of the working tree
# (build/asan-tree, kept between runs so that only changed sources recompile),
# so that the package's own build is left as it is. A use-after-free that
# crashes only now and then in CI is reported here at its first read.
#   tools/test_with_asan.sh [pytest args]     (default: the whole suite)
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/asan-tree
mkdir -p "$tree"
find "$tree" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
# (tar keeps the files' times: ninja recompiles only what changed)
git ls-files -z -co --exclude-standard | tar --null -cf - -T - | tar -xf - -C "$tree"
cd "$tree"
ASAN=1 python setup.py -q build_ext --inplace
if [ $# -eq 0 ]; then set -- test; fi
# libstdc++ is preloaded with ASan's runtime so that its __cxa_throw
# interceptor finds the real one (torch's errors are thrown through it).
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}" \
  PYTHONPATH="$PWD" python -X faulthandler -m pytest "$@" -q -p no:cacheprovider
