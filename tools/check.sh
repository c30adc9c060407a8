#!/usr/bin/env bash
# The static checks CI runs before the tests (configured in pyproject.toml): ruff's lint, ruff's format check and
# mypy over hops_calib/. Each runs even when one before it fails; the exit status is non-zero when any of them
# failed. tools/format.sh rewrites the tree so that the format check passes.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "check: ruff check hops_calib"
ruff check hops_calib || status=1
echo "check: ruff format --check hops_calib"
ruff format --check hops_calib || status=1
echo "check: mypy (hops_calib)"
mypy || status=1
exit "$status"
