#!/usr/bin/env bash
# Install with the test tools and run the test suite: scripts/test.sh [pytest options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec .venv/bin/python -m pytest -q "$@"
