"""What the OpenAI API's features cost: tokens/s of greedy chat completions with no feature, with log-probabilities
(`logprobs: true, top_logprobs: 1`) and with a JSON schema (`response_format`), on specdec-exact serve (its defaults)
and on upstream llama-server (its defaults, the same GGUF file), side by side in one run.

Every prompt asks for a JSON record; each round sends every prompt with every feature to every server in turn (the
features' and the servers' order rotated), streamed, prefill included, as `python -m benchmarks servers` measures.
Every request reads its prompt cold and drafts from nothing earlier: llama-server is asked not to reuse its cached
prompt (`cache_prompt: false`), and specdec gets each (round, feature) under an API key of its own, whose requests
draw on no other key's cached prompts or answers (the same prompt is sent once per feature and round, and a suffix
lookup would otherwise copy the earlier answer).

    .venv/bin/python -m benchmarks.api_features --out docs/api-features-zen4

Writes results.json (every request) and report.md (tokens/s per server and feature, each feature's over none, and
specdec over llama-server per feature), the servers' logs in logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
from pathlib import Path

import httpx
import openai

from benchmarks.harness import (add_common_arguments, ask, client_of, measure_and_keep, rerender, results_header,
                                rotation, setup_of, start_servers)
from benchmarks.servers import SERVERS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"], "properties": {
    "people": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                          "required": ["name", "age", "city"],
                                          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                         "city": {"type": "string"}}}}}}
PROMPTS = [
    "Extract every person in this text as JSON with their name, age and city: Maria Lopez, 34, moved from Seville to "
    "Lyon last spring. Her brother Pablo (29) still lives in Seville, and their friend Ken Ito, 41, visits from Osaka.",
    "List the people in these minutes as JSON (name, age, city): Present were Dr. Anna Berg (52, Oslo), the treasurer "
    "Tom Reyes, aged 38, from Manila, and a new member, Lea Novak, who is 23 and lives in Ljubljana.",
    "Give me JSON of the characters: In the story, Old Sam (70) runs a bakery in Dublin; his granddaughter Ivy, 12, "
    "spends summers there; and a stranger called Victor, 45, arrives from Prague.",
    "Turn this into JSON with name, age and city for each person: Priya Shah, 27, Mumbai; Jonas Weber, 61, Bremen; "
    "Aiko Tanaka, 35, Kyoto; Diego Alvarez, 19, Quito.",
    "Who is in this note? Answer as JSON (name, age, city). 'Hi all - Grace (31) flies in from Nairobi on Friday, and "
    "my cousin Oskar, who just turned 44, drives down from Gdansk. Mum (68, Leeds) is hosting.'",
    "From this hotel register, give JSON of the guests with name, age and city: Room 4: Hannah Klein, 56, Vienna. "
    "Room 7: Omar Haddad, 33, Beirut. Room 9: Chloe Martin, 24, Montreal.",
]
FEATURES = {
    "none": {},
    "logprobs": {"logprobs": True, "top_logprobs": 1},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA,
                                                                              "strict": True}}},
}
SERVER_NAMES = ("llama-server", "specdec")


def run(args) -> int:
    setup = setup_of(args)
    out = Path(args.out)
    results = {**results_header("specdec-api-features/1", setup),
               "command": shlex.join(["python", "-m", "benchmarks.api_features", *sys.argv[1:]]),
               "settings": {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": setup.threads,
                            "features": FEATURES, "prompts": PROMPTS},
               "records": []}
    out.mkdir(parents=True, exist_ok=True)
    keys = {(round_, feature): f"key-{round_}-{feature}" for round_ in range(args.rounds) for feature in FEATURES}
    (out / "keys").write_text("\n".join(["warm-up", *keys.values()]) + "\n")
    servers = [SERVERS[name].server(name, setup) for name in SERVER_NAMES]
    servers = [dataclasses.replace(server, argv=server.argv + ("--api-key-file", str(out / "keys")))
               if not server.baseline else server for server in servers]

    def measure() -> None:
        with contextlib.ExitStack() as stack:
            running = start_servers(stack, servers, out, args.startup_timeout, results)
            for name, (server, proc, client, _) in list(running.items()):  # specdec's routes need a key
                if not server.baseline:
                    plan = httpx.get(f"{proc.url}/v1/specdec/plan", headers={"Authorization": "Bearer warm-up"})
                    results["servers"][name].update(model=setup.target, kernel_plan=plan.json())
                    running[name] = running[name]._replace(model=setup.target)
            for name, (server, proc, _, model) in running.items():  # warm-up, not measured
                for feature, extra in FEATURES.items():
                    ask(client_of(proc.url, "warm-up"), model,
                        "Give JSON of: Ann, 30, Rome.", 16, server.token_ids, extra_body=extra)
            turn = 0
            for round_ in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):
                    # the features in turn too: the first request of a prompt reads it cold, the others may reuse it
                    for feature in rotation(list(FEATURES), round_ * len(PROMPTS) + i):
                        extra = FEATURES[feature]
                        order = rotation(list(running), turn)
                        turn += 1
                        for name in order:
                            server, proc, _, model = running[name]
                            client = client_of(proc.url, keys[round_, feature])
                            cold = {"cache_prompt": False} if server.baseline else {}
                            try:
                                record = ask(client, model, prompt, args.max_tokens, server.token_ids,
                                             extra_body={**extra, **cold})
                            except openai.OpenAIError as error:  # counted in the report, not fatal
                                record = {"error": f"{type(error).__name__}: {error}", "completion_tokens": 0,
                                          "wall_s": 0.0, "tokens_per_s": 0.0}
                            proc.check_alive()
                            results["records"].append({"server": name, "feature": feature, "round": round_,
                                                       "prompt": i, **record})
                            print(f"round {round_ + 1} prompt {i} {feature:<12} {name:<13} "
                                  f"{record['tokens_per_s']:6.2f} tokens/s", file=sys.stderr, flush=True)

    return measure_and_keep(measure, results, out, report)


def rates(results: dict, decode: bool = False) -> dict[str, dict[str, float]]:
    """server -> feature -> pooled tokens/s: all completion tokens / all seconds, or (decode) the tokens after the
    first / the seconds after the first token, which leaves out the prefill (and what a prompt cache saved)."""
    found: dict[str, dict[str, float]] = {}
    for name in {r["server"] for r in results["records"]}:
        for feature in FEATURES:
            mine = [r for r in results["records"] if r["server"] == name and r["feature"] == feature
                    and "error" not in r]
            if decode:
                mine = [r for r in mine if r.get("first_token_s") is not None and r["completion_tokens"] > 1]
                tokens = sum(r["completion_tokens"] - 1 for r in mine)
                seconds = sum(r["wall_s"] - r["first_token_s"] for r in mine)
            else:
                tokens, seconds = sum(r["completion_tokens"] or 0 for r in mine), sum(r["wall_s"] for r in mine)
            if seconds:
                found.setdefault(name, {})[feature] = tokens / seconds
    return found


def report(results: dict) -> str:
    machine = results["machine"]
    lines = ["# The API's features: specdec-exact serve against llama-server", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {machine['cpu']}, {machine['cores']} cores  ",
             f"Versions: {results['versions']}; llama-server: {results.get('llama_server')}  ",
             f"Greedy chat completions of at most {results['settings']['max_tokens']} tokens, "
             f"{results['settings']['rounds']} round(s) of {len(results['settings'].get('prompts', PROMPTS))} "
             "prompts, each with every feature (features and servers in turn)."]
    for decode, title in ((False, "Tokens/s, prefill included (completion tokens / wall seconds)"),
                          (True, "Decode tokens/s (the tokens after the first / the seconds after it)")):
        rate = rates(results, decode)
        servers = [name for name in SERVER_NAMES if name in rate]
        lines += ["", f"## {title}", "",
                  "| server | " + " | ".join(FEATURES) + " | "
                  + " | ".join(f"{f} / none" for f in FEATURES if f != "none") + " |",
                  "|---" * (1 + 2 * len(FEATURES) - 1) + "|"]
        for name in servers:
            row = [f"{rate[name].get(f, 0):.2f}" for f in FEATURES]
            row += [f"{rate[name][f] / rate[name]['none']:.2f}x" if rate[name].get("none") and f in rate[name]
                    else "-" for f in FEATURES if f != "none"]
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        if {"specdec", "llama-server"} <= set(rate):
            ratios = [f"{f} {rate['specdec'][f] / rate['llama-server'][f]:.2f}x" for f in FEATURES
                      if rate["specdec"].get(f) and rate["llama-server"].get(f)]
            lines += ["", "specdec over llama-server, per feature: " + ", ".join(ratios) + "."]
    failed = [r for r in results["records"] if "error" in r]
    lines += ["", f"Requests: {len(results['records'])}, failed: {len(failed)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "api-features-results")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.report:
        return rerender(Path(args.report), report)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
