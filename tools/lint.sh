#!/usr/bin/env bash
# Lint, format and type checks, as CI runs them (.ci/run). Needs the tools
# pinned in tools/lint-requirements.txt:  pip install -r tools/lint-requirements.txt
#   tools/lint.sh          check
#   tools/lint.sh --fix    apply ruff's fixes and both formatters, then check
set -euo pipefail
cd "$(dirname "$0")/.."
CPP=(csrc/*.cpp csrc/*.h)
if [[ "${1:-}" == "--fix" ]]; then
  ruff check --fix .
  ruff format .
  clang-format -i "${CPP[@]}"
fi
ruff check .
ruff format --check .
clang-format --dry-run --Werror "${CPP[@]}"
mypy
echo "lint: ok"
