#!/usr/bin/env bash
# The quick benchmark before and after the one-decoding-path redesign (issue #26), interleaved (before, after,
# before, after) on the same machine in one run. BEFORE: a checkout of the last commit before the redesign
# (git worktree add /tmp/before 2e1e0bb), run with this checkout's virtual env.
set -euo pipefail
cd "$(dirname "$0")/../.."
BEFORE=${BEFORE:-/tmp/before}
HERE=$PWD
ARGS=(bench --preset quick --methods target-only,draft@auto,suffix@auto --sampled-methods "")
for round in ${ROUNDS:-1 2}; do
    (cd "$BEFORE" && PYTHONPATH="$BEFORE" "$HERE/.venv/bin/python" -m specdec.cli "${ARGS[@]}" \
        --out "$HERE/docs/redesign-bench/before-$round")
    .venv/bin/python -m specdec.cli "${ARGS[@]}" --out "docs/redesign-bench/after-$round"
done
