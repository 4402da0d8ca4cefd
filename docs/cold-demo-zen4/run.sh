#!/bin/bash
# A cold `make demo`: a fresh clone of REPO, an empty specdec cache (wheels, models, llama-server, calibrations) and
# an empty pip cache, under ROOT (deleted first). Writes ROOT/machine.txt and ROOT/demo.log (every line timestamped,
# then /usr/bin/time -v's figures and the exit status).
#
#   docs/cold-demo-zen4/run.sh ROOT REPO
set -u
root=${1:?root} repo=${2:?repo}
rm -rf "$root"; mkdir -p "$root"
git clone -q "$repo" "$root/repo"
cd "$root/repo"
export SPECDEC_CACHE="$root/cache" PIP_CACHE_DIR="$root/pip"
{ date -u +%FT%TZ; grep -m1 'model name' /proc/cpuinfo; grep -m1 -E '^cpu family' /proc/cpuinfo; grep -m1 -E '^model\s' /proc/cpuinfo; nproc; git log --oneline -1; } > "$root/machine.txt"
start=$(date +%s)
/usr/bin/time -v make demo 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done > "$root/demo.log"
echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" >> "$root/demo.log"
