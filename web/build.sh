#!/usr/bin/env bash
# Rebuild the dashboard into the Python package (coli/web_dist), or into $1 when given
# (tests/test_web.py builds into a temporary folder and compares it with the committed build).
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules ] || npm ci --no-audit --no-fund
if [ $# -ge 1 ]; then export COLI_WEB_OUT="$(realpath -m "$1")"; fi
npx tsc -p .
npx vite build --logLevel warn
