"""How the per-cycle choice of drafts would do on answers already recorded, without a model: a quick check of a change
to its rules or priors (specdec_exact/drafters/choice.py) before a benchmark run.

Each recorded greedy answer is replayed after its prompt: every cycle asks the choice (suffix lookup or a plain step,
as the default drafter decides where the draft model is left out) for a draft, accepts the prefix that the recorded
answer goes on with, and charges the calibrated cost of the target pass over that many tokens (`specdec-exact calibrate
--json`'s pass_ms). The prediction is the decoding speed-up over target-only: answer tokens over the passes' cost in
one-token passes. It leaves out what a run also pays (the prompt's prefill, the Python of each cycle, the noise of a
shared machine) and each answer is replayed alone, without the earlier requests a server's lookup also draws on; it
compares rules, it does not replace the servers benchmark.

    .venv/bin/python -m benchmarks.choice_replay --costs docs/first-start-zen4-setup/setup/calibrate.json \
        --servers docs/servers-zen4-margin-a/results.json --lookups docs/lookup-acceptance/results.json \
        [--bands 1:0.45,2:0.6,4:0.7,8:0.9,16:0.95]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdec_exact.drafters import choice
from specdec_exact.drafters.choice import ChoosingDrafter, Costs, ServedPassCosts
from specdec_exact.drafters.suffix import SuffixDrafter

PROMPTS = Path(__file__).parent / "data" / "server_prompts.json"


def replay(prompt_ids: list[int], answer: list[int], verify) -> float:
    """The passes' cost of decoding `answer` after `prompt_ids`, in one-token passes."""
    drafter = ChoosingDrafter(SuffixDrafter(), None, Costs(ServedPassCosts(verify), draft_step=0.0))
    drafter.begin(torch.tensor([prompt_ids]))
    position, cost = 0, 0.0
    while position < len(answer):
        draft = drafter.propose(torch.tensor([prompt_ids + answer[:position]]), 15, None, None).tokens[0].tolist()
        accepted = 0
        while (accepted < len(draft) and position + accepted < len(answer)
               and draft[accepted] == answer[position + accepted]):
            accepted += 1
        drafter.accept(len(draft), accepted)
        cost += verify(len(draft) + 1)
        position += accepted + 1
    return cost


def cases(servers: Path | None, lookups: Path | None, server: str, tokenizer) -> list[tuple[str, list, list]]:
    """(kind, prompt ids, answer ids) of the recorded answers."""
    found = []
    if servers is not None:
        prompts = {p["id"]: p["prompt"] for p in json.loads(PROMPTS.read_text())["prompts"]}
        for record in json.loads(servers.read_text())["records"]:
            if record["server"] == server and record.get("token_ids"):
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[record["prompt_id"]]}],
                                                     tokenize=False, add_generation_prompt=True)
                prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                found.append((f"servers {record['kind']}", prompt_ids, record["token_ids"]))
    if lookups is not None:
        for answer in json.loads(lookups.read_text())["answers"]:
            found.append((f"workloads {answer['kind']}", answer["prompt_ids"], answer["token_ids"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="`specdec-exact calibrate --json` output (pass_ms)")
    parser.add_argument("--servers", type=Path, help="a servers benchmark's results.json (its answers' token ids)")
    parser.add_argument("--server", default="specdec-target-only",
                        help="whose answers to replay (default: %(default)s)")
    parser.add_argument("--lookups", type=Path, help="lookup_acceptance's results.json (its answers)")
    parser.add_argument("--bands", help="MATCH_BANDS to try instead, as MATCHED:PRIOR,... (e.g. 1:0.45,2:0.6,8:0.9)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer renders the prompts")
    args = parser.parse_args()
    if args.servers is None and args.lookups is None:
        parser.error("give --servers, --lookups or both: the answers to replay")
    milliseconds = {int(width): ms for width, ms in json.loads(args.costs.read_text())["pass_ms"]["target"].items()}

    def verify(width: int) -> float:
        return milliseconds[width] / milliseconds[1]

    if args.bands:
        bands = {int(matched): float(prior) for matched, prior in (item.split(":") for item in args.bands.split(","))}
        choice.MATCH_BANDS.clear()
        choice.MATCH_BANDS.update(bands)
    from specdec_exact import registry
    from specdec_exact.runtimes.llamacpp import read_tokenizer

    tokenizer = read_tokenizer(registry.gguf_tokenizer_dir(registry.gguf_file(args.target)))
    totals = defaultdict(lambda: [0, 0.0])  # kind -> [answer tokens, cost]
    for kind, prompt_ids, answer in cases(args.servers, args.lookups, args.server, tokenizer):
        totals[kind][0] += len(answer)
        totals[kind][1] += replay(prompt_ids, answer, verify)
    print(f"bands {choice.MATCH_BANDS}; predicted decoding speed-up over target-only, per kind of answer:")
    for kind, (tokens, cost) in sorted(totals.items()):
        print(f"  {kind}: {tokens / cost:.3f}x ({tokens} tokens)")


if __name__ == "__main__":
    main()
