#!/usr/bin/env bash
# The first start after set-up: `make calibrate`'s step (`specdec calibrate`, the default pair, every core) on an empty
# calibration cache, then `specdec serve` twice through docs/first-start-zen4/run.sh: with the same thread count
# (what the set-up calibrated) and with one thread (a thread count the set-up did not time).
# Usage: SPECDEC_CACHE=CACHE docs/first-start-zen4-setup/run.sh OUT PORT
# CACHE holds the model files (links to ~/.cache/specdec's gguf, tokenizers, verified and the model folders) and no
# calibration/ folder.
set -u
out=${1:?an output folder}; port=${2:-8411}
cd "$(dirname "$0")/../.."  # the repository
: "${SPECDEC_CACHE:?a cache with the models and no calibration/ folder}"
if [ -e "$SPECDEC_CACHE/calibration" ]; then echo "$SPECDEC_CACHE/calibration exists: this measures a first start" >&2; exit 2; fi
mkdir -p "$out/setup" "$out/serve" "$out/serve-threads-1"
start=$(date +%s.%N)
.venv/bin/specdec calibrate --json > "$out/setup/calibrate.json" 2> "$out/setup/calibrate.log" || exit 1
echo "$(date +%s.%N) - $start" | bc > "$out/setup/seconds.txt"
docs/first-start-zen4/run.sh "$out/serve" 2 "$port"
docs/first-start-zen4/run.sh "$out/serve-threads-1" 1 "$port"
