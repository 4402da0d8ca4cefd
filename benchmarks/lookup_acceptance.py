"""How often the target accepts a suffix lookup's draft, by match length and by whether the matched occurrences agreed.

The priors of the per-cycle choice (specdec_exact/drafters/choice.py: MATCH_BANDS, SPLIT_PRIOR) come from this
measurement. It decodes prompts of the packaged workloads that the benchmarks do not use (HumanEval, ASDiv and XSum from
the 21st on) greedily with the target alone, then replays each answer: after every token, a suffix lookup over the
earlier prompts and answers, the prompt and the answer so far, compared with what the target went on to say.

    .venv/bin/python benchmarks/lookup_acceptance.py --out docs/lookup-acceptance

Writes results.json (every lookup: kind, match length, agreement, draft length, accepted tokens) and report.md;
`--report docs/lookup-acceptance/results.json` re-renders the report from the data with the current bands.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdec_exact import SpeculativeGenerator
from specdec_exact.bench.runner import machine_info, versions
from specdec_exact.bench.workloads import load_asdiv, load_humaneval, load_xsum
from specdec_exact.drafters.choice import MATCH_BANDS
from specdec_exact.drafters.suffix import SEPARATOR, SuffixDrafter, suffix_draft

WORKLOADS = (("code", load_humaneval, 8, 400), ("maths", load_asdiv, 12, 400), ("summary", load_xsum, 5, 700))
SKIP = 20  # the benchmarks take their prompts from the start of each file


def answers(generator: SpeculativeGenerator, max_new_tokens: int) -> list[dict]:
    """Greedy target-only answers to the workloads' prompts -> [{kind, source, prompt_ids, token_ids}]."""
    found = []
    for kind, load, count, max_prompt in WORKLOADS:
        taken = 0
        for prompt in itertools.islice(load(), SKIP, None):
            ids = generator.encode([{"role": "user", "content": prompt.text}], chat=True)
            if len(ids) > max_prompt:
                continue
            result = generator.generate(ids, max_new_tokens=max_new_tokens)
            found.append({"kind": kind, "source": prompt.source, "prompt_ids": ids, "token_ids": result.token_ids})
            print(f"{kind} {prompt.source}: {len(ids)} prompt tokens, {len(result.token_ids)} answered", flush=True)
            taken += 1
            if taken == count:
                break
    return found


def replay(found: list[dict], k: int = 8) -> list[dict]:
    """A lookup after every answer token, as the server's suffix drafter makes it (its defaults, the earlier
    prompts and answers as its history) -> one record per lookup that drafted."""
    drafter, lookups = SuffixDrafter(), []
    history = np.full(0, SEPARATOR, dtype=np.int64)
    for answer in found:
        prompt, said = answer["prompt_ids"], answer["token_ids"]
        for i in range(len(said)):
            corpus = np.concatenate([history, np.array(prompt + said[:i], dtype=np.int64)])
            draft, matched, probabilities = suffix_draft(corpus, k, drafter.max_match, drafter.min_probability)
            if not draft:
                continue
            accepted = next((j for j, (a, b) in enumerate(zip(draft, said[i:])) if a != b), min(len(draft),
                                                                                                 len(said) - i))
            lookups.append({"kind": answer["kind"], "matched": matched, "agreement": probabilities[0],
                            "drafted": len(draft), "accepted": accepted})
        history = np.concatenate([history, np.array(prompt + said, dtype=np.int64), [SEPARATOR]])
    return lookups


def table(lookups: list[dict]) -> list[str]:
    """Per band of match lengths and agreement: lookups, first draft token accepted, accepted per tested token."""
    cells = defaultdict(lambda: [0, 0, 0, 0])
    for lookup in lookups:
        band = max(b for b in MATCH_BANDS if b <= lookup["matched"])
        cell = cells[(band, lookup["agreement"] >= 1.0)]
        tested = min(lookup["drafted"], lookup["accepted"] + 1)
        cell[0], cell[1], cell[2], cell[3] = cell[0] + 1, cell[1] + (lookup["accepted"] > 0), \
            cell[2] + lookup["accepted"], cell[3] + tested
    rows = ["| matched tokens (at least) | occurrences agreed | lookups | first token accepted | accepted per tested "
            "token |", "|---|---|---|---|---|"]
    for (band, agreed), (n, first, accepted, tested) in sorted(cells.items()):
        rows.append(f"| {band} | {'yes' if agreed else 'no'} | {n} | {first / n:.0%} | {accepted / tested:.0%} |")
    return rows


def report(results: dict, max_tokens: int) -> str:
    return "\n".join([
        "# Suffix lookups accepted by the target", "",
        f"Command: `.venv/bin/python {results['command']}`  ",
        f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores  ",
        f"{len(results['answers'])} greedy answers of `{results['target']}` (at most {max_tokens} tokens) to prompts "
        f"of the packaged workloads from the {SKIP + 1}st of each file on; a lookup after every answer token, "
        f"{len(results['lookups'])} of which drafted.", "", *table(results["lookups"]), ""])


def write(folder: Path, name: str, text: str) -> None:
    partial = folder / f".{name}.partial"
    partial.write_text(text)
    os.replace(partial, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("lookup-acceptance"))
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON",
                        help="re-render report.md beside this results.json (with the current bands), measuring nothing")
    args = parser.parse_args()
    if args.report is not None:
        results = json.loads(args.report.read_text())
        write(args.report.parent, "report.md", report(results, args.max_tokens))
        print("\n".join(table(results["lookups"])))
        return
    generator = SpeculativeGenerator(args.target, draft=None)
    found = answers(generator, args.max_tokens)
    lookups = replay(found)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"command": f"benchmarks/lookup_acceptance.py --out {args.out}", "target": args.target,
               "machine": machine_info(), "versions": versions(), "kernel_plans": generator.kernel_plans(),
               "answers": found, "lookups": lookups}
    write(args.out, "results.json", json.dumps(results))
    write(args.out, "report.md", report(results, args.max_tokens))
    print("\n".join(table(lookups)))


if __name__ == "__main__":
    main()
