#!/usr/bin/env bash
# Runs torch_autobatch's test suite and main demo against one torch release, in a
# venv of its own, on a copy of this working tree (so the build of one torch never
# mixes with another's).
#
#   tools/test_with_torch.sh VERSION [pytest args...]
#   tools/test_with_torch.sh 2.14.1
#   PIP_CONFIG_FILE=/dev/null tools/test_with_torch.sh 2.15.0   # from PyPI, past a local pip cap
#
# VENVS (default: .venvs in the project root) holds one venv per release, reused
# on the next run: torch is installed into it once. Exits non-zero if the build,
# a test or the demo fails.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 TORCH_VERSION [pytest args...]" >&2; exit 2; }
version=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENVS:-$root/.venvs}/torch-$version
src=$venv/src
deps=(setuptools wheel ninja numpy pytest expecttest hypothesis)

echo "== torch $version: venv $venv"
if [ ! -x "$venv/bin/python" ]; then
  python -m venv "$venv"
fi
"$venv/bin/pip" install -q "${deps[@]}"
"$venv/bin/pip" install -q "torch==$version"
# real libraries the tests lift (test/test_lift.py), without their dependencies: pip never swaps torch
"$venv/bin/pip" install -q --no-deps entmax pytorch-wavelets PyWavelets
# the zoo (test/test_zoo.py, docs/zoo.md): real libraries' Functions lifted whole, also without dependencies
"$venv/bin/pip" install -q --no-deps pytorch-revgrad==0.2.0 sparsemax==0.1.9 geomloss==0.3.1 pyro-ppl==1.9.2 pyro-api==0.1.2 opt_einsum==3.4.0 tqdm==4.70.1 torchdiffeq==0.2.5 memory-efficient-attention-pytorch==0.1.6 einops==0.8.2 snntorch==1.0.0 linear-operator==0.6.1 scipy==1.17.1
# ONNX export and onnxruntime (test/test_onnx.py), also without dependencies: pip never swaps torch
"$venv/bin/pip" install -q --no-deps onnx onnxscript onnx-ir onnxruntime ml_dtypes protobuf flatbuffers
"$venv/bin/python" -c "import torch; print('== running torch', torch.__version__)"

# The tracked and untracked (not ignored) files of this tree: sources, no builds.
# A previous run's build/ stays, so only what changed is compiled again.
mkdir -p "$src"
find "$src" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z --cached --others --exclude-standard |
    xargs -0 tar -cf - --ignore-failed-read) | tar -xf - -C "$src"
else
  (cd "$root" && tar -cf - --exclude=.venvs --exclude=build --exclude='*.so' .) | tar -xf - -C "$src"
fi

cd "$src"
start=$SECONDS
"$venv/bin/pip" install -q --no-build-isolation --no-deps -e .
echo "== built in $((SECONDS - start)) s"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:-test}"
"$venv/bin/python" examples/quickstart.py
