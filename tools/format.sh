#!/usr/bin/env bash
# Rewrite hops_calib/ in the house format (pyproject.toml's [tool.ruff.format]) and apply ruff's safe lint fixes
# (import order among them), so that tools/check.sh passes its format check.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff format hops_calib
ruff check --fix hops_calib
