"""The runs of this folder together: each specdec server's tokens/s over the fastest llama-server configuration's, per
kind and pooled (completion tokens over wall seconds, prefill included, summed over the runs' requests), the default
against its own `--draft none`, and what each server spent outside its own account of a request (wall time minus
specdec's time_s.total, or llama-server's prompt_ms + predicted_ms: HTTP, the chat template, and work done before or
after the engine's span), median and range. Usage: python3 docs/servers-zen4-keep-after/together.py RESULTS.json ..."""

import json
import statistics
import sys
from collections import defaultdict

KINDS = ("code-edit", "document-qa", "chat", "maths", "translation", "summary", "all")


def main(paths: list[str]) -> None:
    tokens, seconds, outside = defaultdict(float), defaultdict(float), defaultdict(list)
    for path in paths:
        for record in json.load(open(path))["records"]:
            if "error" in record or not record.get("completion_tokens"):
                continue
            server, stats = record["server"], record.get("server_stats") or {}
            for kind in (record["kind"], "all"):
                tokens[server, kind] += record["completion_tokens"]
                seconds[server, kind] += record["wall_s"]
            if "time_s" in stats:
                outside[server].append(record["wall_s"] - stats["time_s"]["total"])
            elif "prompt_ms" in stats:
                outside[server].append(record["wall_s"] - (stats["prompt_ms"] + stats["predicted_ms"]) / 1e3)
    servers = sorted({server for server, _ in tokens})
    rate = {(server, kind): tokens[server, kind] / seconds[server, kind] for server, kind in tokens}
    best = {kind: max(rate[s, kind] for s in servers if s.startswith("llama-server")) for kind in KINDS}
    print("| server | " + " | ".join(KINDS) + " |")
    for server in servers:
        if server.startswith("specdec"):
            print(f"| {server} | " + " | ".join(f"{rate[server, k] / best[k]:.3f}x" for k in KINDS) + " |")
    print("| default over its own --draft none | " + " | ".join(
        f"{rate['specdec', k] / rate['specdec-target-only', k]:.3f}x" for k in KINDS) + " |")
    print(f"{len(paths)} runs; outside each server's own account of a request, median (range), ms:")
    for server in servers:
        ms = [1e3 * s for s in outside[server]]
        print(f"  {server}: {statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})")


if __name__ == "__main__":
    main(sys.argv[1:])
