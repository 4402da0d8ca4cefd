#!/usr/bin/env bash
# First start of `specdec serve` with an empty calibration cache: the port answers at once, /health 503 with the
# progress until the models serve, then 200. Writes health.jsonl (one probe every 5 s) and serve.log.
set -u
out=${1:-/tmp/firststart}; threads=${2:-2}; port=${3:-8411}
cd "$(dirname "$0")/../.."  # the repository
start=$(date +%s.%N)
SPECDEC_CACHE=${SPECDEC_CACHE:?a cache with the models and an empty calibration/ folder} .venv/bin/specdec serve --threads "$threads" --port "$port" > "$out/serve.log" 2>&1 &
pid=$!
: > "$out/health.jsonl"
while kill -0 $pid 2>/dev/null; do
  now=$(date +%s.%N)
  body=$(curl -s -o "$out/body" -w "%{http_code}" "http://127.0.0.1:$port/health" 2>/dev/null)
  printf '{"t": %.1f, "code": "%s", "body": %s}\n' "$(echo "$now - $start" | bc)" "$body" "$(cat "$out/body" 2>/dev/null || echo null)" >> "$out/health.jsonl"
  [ "$body" = "200" ] && break
  sleep 5
done
ready=$(date +%s.%N)
echo "ready after $(echo "$ready - $start" | bc) s" | tee "$out/ready.txt"
curl -s "http://127.0.0.1:$port/v1/chat/completions" -H "Content-Type: application/json" \
  -d '{"model": "qwen2.5-coder-1.5b-instruct", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}' > "$out/answer.json"
kill $pid; wait $pid 2>/dev/null
