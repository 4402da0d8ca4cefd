"""Each server's own account of its requests, from the runs given: decoding time per completion token on chat, maths
and translation (specdec's time_s.verify, llama-server's predicted_ms; median over the requests), and the prefill
rate of the long prompts of code edits, document questions and summaries (new prompt tokens over specdec's
time_s.prefill or llama-server's prompt_ms, summed). Usage:
python3 docs/servers-zen4-one-token-rounds/own_accounts.py RESULTS.json ..."""

import json
import statistics
import sys
from collections import defaultdict

DECODING = ("chat", "maths", "translation")
LONG_PROMPTS = ("code-edit", "document-qa", "summary")


def main(paths: list[str]) -> None:
    per_token, prompt_tokens, prompt_s = defaultdict(list), defaultdict(int), defaultdict(float)
    for path in paths:
        for record in json.load(open(path))["records"]:
            stats, server = record.get("server_stats") or {}, record["server"]
            if "time_s" in stats:
                decode_s, prefill_s = stats["time_s"]["verify"], stats["time_s"]["prefill"]
            elif "predicted_ms" in stats:
                decode_s, prefill_s = stats["predicted_ms"] / 1e3, stats["prompt_ms"] / 1e3
            else:
                continue
            if record["kind"] in DECODING:
                per_token[server].append(1e3 * decode_s / record["completion_tokens"])
            if record["kind"] in LONG_PROMPTS:
                prompt_tokens[server] += record["prompt_tokens"] - (record.get("cached_tokens") or 0)
                prompt_s[server] += prefill_s
    for server in sorted(per_token):
        print(f"{server}: decoding {statistics.median(per_token[server]):.1f} ms a token (median of "
              f"{len(per_token[server])}), long prompts {prompt_tokens[server] / prompt_s[server]:.1f} tokens/s")


if __name__ == "__main__":
    main(sys.argv[1:])
