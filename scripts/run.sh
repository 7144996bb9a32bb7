#!/usr/bin/env bash
# Install (first time) and run the default model: scripts/run.sh ["prompt"] [edgellm run options]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/edgellm ] || bash scripts/install.sh
if [ $# -eq 0 ]; then
  set -- --temperature 0 "What is the capital of France?"
fi
exec .venv/bin/edgellm run "$@"
