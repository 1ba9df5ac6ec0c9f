#!/usr/bin/env bash
# Build Grafana's own dashboard JSON schema (from @grafana/schema 11.6, the flavour the dashboards
# are generated for) once into a cache directory and print its path. The npm packages pinned in
# package.json next to this script (also the prometheus-operator models the k8s check uses) come from
# tests/deploy/node_modules when .ci/setup installed them there, else are installed into the cache.
# Usage: tests/deploy/grafana_schema.sh [CACHE_DIR]   (default: $HPAR_NPM_CACHE or ~/.cache/hpar-deploy)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:-${HPAR_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpar-deploy}}"
mkdir -p "$cache"
if [ -x "$here/node_modules/.bin/ts-json-schema-generator" ]; then
  nodedir="$here"
else
  nodedir="$cache"
  if ! cmp -s "$here/package.json" "$cache/package.json" || [ ! -d "$cache/node_modules" ]; then
    cp "$here/package.json" "$cache/package.json"
    (cd "$cache" && npm install --no-audit --no-fund --loglevel=error >&2)
    rm -f "$cache/dashboard.schema.json"
  fi
fi
out="$cache/dashboard.schema.json"
if [ ! -s "$out" ]; then
  # the raw dashboard types moved between @grafana/schema releases: take whichever this one ships
  src=$(ls "$nodedir"/node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts \
           "$nodedir"/node_modules/@grafana/schema/dist/esm/raw/dashboard/x/dashboard_types.gen.d.ts \
           2>/dev/null | head -1 || true)
  "$nodedir/node_modules/.bin/ts-json-schema-generator" --path "$src" \
    --type Dashboard --no-type-check --additional-properties -o "$out.tmp" >&2
  mv "$out.tmp" "$out"
fi
echo "$out"
