#!/usr/bin/env bash
# The static checks CI runs before the tests (configured in pyproject.toml): ruff's lint and mypy over hops_calib/.
# Each runs even when one before it fails; the exit status is non-zero when any of them failed. ruff's format check
# joins them once the tree is formatted (tools/format.sh): formatting today rewrites 103 of the package's files and
# grows it from about 26,000 to 32,500 lines, so it waits for the last module splits of issue #30 to land first.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "check: ruff check hops_calib"
ruff check hops_calib || status=1
echo "check: mypy (hops_calib)"
mypy || status=1
exit "$status"
