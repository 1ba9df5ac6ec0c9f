#!/usr/bin/env bash
# Re-take docs/report.png: run the demo as the README's quick start does, then screenshot the top of its (ranks, step anatomy, alerts, step time, pipeline schedule)
# report.html in headless Chromium (apt: chromium). Run from the repository root in the project's venv.
set -euo pipefail
work=$(mktemp -d)
(cd "$work" && hpar-agent demo --metrics-port 0 >demo.log 2>&1) || { tail -30 "$work/demo.log"; exit 1; }
page=$(ls "$work"/hpar-runs/demo-*/report.html)
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1900 \
  --virtual-time-budget=15000 --screenshot="$PWD/docs/report.png" "file://$page" 2>/dev/null
rm -rf "$work"
