"""`specdec-exact bench`: load one target and one draft model, run every method on real prompts, save and report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from specdec_exact.options import add_generation_args, generator_from_args
from specdec_exact.runtimes import runtime_of

DEFAULT_OUT = "bench-results"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from specdec_exact.bench.runner import ALL_METHODS, PRESETS

    parser = subparsers.add_parser(
        "bench", help="benchmark speculative decoding against target-only and transformers' peers",
        description="Run every method on the same real prompts (HumanEval, XSum, ASDiv) with one shared target and "
                    "draft model; write results.json (raw measurements), report.md and PNG plots.")
    add_generation_args(parser)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                        help="smoke: tiny models in CI; quick: ~15 min on 2 CPU cores; full (default: %(default)s)")
    parser.add_argument("--prompts", metavar="FILE.jsonl",
                        help='use these prompts (one {"prompt": ...} per line, optional "task") instead of the '
                             "packaged workloads")
    parser.add_argument("--tasks", help="comma-separated subset of the packaged workloads: code,summarisation,maths")
    parser.add_argument("--methods", help=f"comma-separated methods at temperature 0 instead of the preset's, "
                                          f"NAME[@K] (all: {','.join(ALL_METHODS)}); target-only always runs")
    parser.add_argument("--sampled-methods", help="comma-separated methods at temperature 0.7 ('' for none)")
    parser.add_argument("--prompts-per-task", type=int, help="override the preset")
    parser.add_argument("--max-new-tokens", type=int, help="override the preset")
    parser.add_argument("--max-prompt-tokens", type=int, help="override the preset")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of prompt 0; prompt i uses seed + i")
    parser.add_argument("--no-chat", action="store_true", help="feed prompts as plain text even if the target has "
                                                               "a chat template")
    parser.add_argument("--out", metavar="DIR", help=f"output directory (default: {DEFAULT_OUT}/; with --report: "
                                                     "the directory of the JSON file)")
    parser.add_argument("--report", metavar="RESULTS.json", help="only re-render the report from a saved results "
                                                                 "file; loads no model")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_bench)
    return parser


def run_bench(args) -> int:
    from specdec_exact.bench import report

    if args.report:
        source = Path(args.report)
        results = json.loads(source.read_text())
        path = report.render(results, Path(args.out) if args.out else source.parent)
        print(f"report: {path}")
        return 0
    return _run(args)


def _split(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(item.strip() for item in text.split(",") if item.strip())


def _preset(args):
    """The named preset with the command line's overrides; target-only, the baseline, always runs first."""
    from specdec_exact.bench.runner import PRESETS

    def with_baseline(methods: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if not methods:
            return methods
        return ("target-only",) + tuple(m for m in methods if m != "target-only")

    overrides = {"prompts_per_task": args.prompts_per_task, "max_new_tokens": args.max_new_tokens,
                 "max_prompt_tokens": args.max_prompt_tokens, "greedy": with_baseline(_split(args.methods)),
                 "sampled": with_baseline(_split(args.sampled_methods)), "tasks": _split(args.tasks)}
    return replace(PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None})


def _candidates(args, preset):
    """{task: (candidate prompts, prefer_long)}: checked before any model loads, so a missing package fails fast."""
    from specdec_exact.bench.workloads import TASKS, load_prompt_file

    if args.prompts:
        by_task = {}
        for prompt in load_prompt_file(args.prompts):
            by_task.setdefault(prompt.task, ([], False))[0].append(prompt)
        return by_task
    unknown = [task for task in preset.tasks if task not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    return {task: (list(TASKS[task].load()), TASKS[task].prefer_long) for task in preset.tasks}


def _run(args) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from specdec_exact.bench.runner import (RESULTS_FILE, SAMPLING_TEMPERATURE, new_results, peak_rss_mb, run_schedule,
                                            save)

    started = time.perf_counter()
    preset = _preset(args)
    out_dir = Path(args.out or DEFAULT_OUT)
    path = out_dir / RESULTS_FILE
    candidates = _candidates(args, preset)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)  # before new_results, which records it
    settings = {"target": args.target, "draft": args.draft, "runtime": args.runtime, "threads": args.threads,
                "dtype": "float32", "seed": args.seed,
                "quantize_draft": args.quantize_draft, "quantize_target": args.quantize_target,
                "sampling_temperature": SAMPLING_TEMPERATURE, "default_k": args.k, "prompts_file": args.prompts}
    results = new_results(preset, _command_line(args), settings)
    hf_logging.set_verbosity_error()  # generate()'s per-call notices would bury the progress
    previous_handler = _sigterm_interrupts()
    schedule = None
    try:
        schedule = _prepare(args, preset, candidates, results)
        progress = "off" if args.no_progress else "bar" if sys.stderr.isatty() else "lines"
        run_schedule(schedule, results, path, progress)
        results["status"] = "complete"
    except KeyboardInterrupt:
        results["status"] = "interrupted"
    except BaseException:
        results["status"] = "failed"
        raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        torch.set_num_threads(threads)
        if schedule is not None:
            results["methods"] = _describe(schedule)  # again: a peer may have had to change how it loads
            for _, methods in schedule.by_temperature:
                for method in methods:
                    method.close()
        results["wall_s"] = time.perf_counter() - started
        results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
        results["memory"]["peak_rss_mb"] = peak_rss_mb()
        saved = save(results, path)  # not when no run finished: an earlier run's file stays as it was
    return _finish(results, out_dir, path, saved)


def _command_line(args) -> list[str]:
    """The command with every setting spelled out, defaults included, so that the report shows how to rerun it."""
    words = ["specdec-exact", "bench", "--preset", args.preset]
    for name in ("target", "draft", "k", "prompts", "tasks", "methods", "sampled_methods", "prompts_per_task",
                 "max_new_tokens", "max_prompt_tokens", "seed", "runtime", "threads", "out"):
        value = getattr(args, name)
        if value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    return words + (["--no-chat"] if args.no_chat else [])


def _sigterm_interrupts():
    """Make a `kill` of a background run keep what was measured, as Ctrl-C does; -> the previous handler (None when
    not on the main thread, where handlers cannot be set)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, interrupt)


def _prepare(args, preset, candidates, results: dict):
    """Load the models, pick the prompts, build the methods, measure the costs, warm up; -> the Schedule."""
    from specdec_exact.bench.costs import VERIFY_WIDTHS, measure_costs
    from specdec_exact.bench.methods import build_methods
    from specdec_exact.bench.runner import SAMPLING_TEMPERATURE, Schedule, peak_rss_mb, warm_up

    print(f"loading {args.target} and {args.draft} ...", file=sys.stderr)
    gen = generator_from_args(args, keep_draft=True)  # its methods measure the draft model, even where it cannot pay
    results["settings"].update(runtime=gen.runtime.name, quantize_draft=gen.draft_quantization or "none")
    if getattr(gen.target, "threads", None):  # a runtime with threads of its own (llama.cpp): not torch's
        results["machine"]["compute_threads"] = gen.target.threads  # what the CPU share is measured against
    results["memory"]["after_load_mb"] = peak_rss_mb()
    results["models"] = {role: runtime_of(model).describe(model)
                         for role, model in (("target", gen.target), ("draft", gen.draft)) if model is not None}
    results["kernel_plans"] = gen.kernel_plans()
    chat = not args.no_chat and getattr(gen.tokenizer, "chat_template", None) is not None
    results["settings"]["chat"] = chat
    units = _units(gen, candidates, preset, chat)
    if not units:
        raise ValueError(f"no prompt fits in {preset.max_prompt_tokens} tokens: raise --max-prompt-tokens")
    results["workloads"] = [{"index": u.index, "task": u.prompt.task, "source": u.prompt.source,
                             "prompt_tokens": int(u.ids.shape[1]), "text": u.prompt.text} for u in units]
    # The runtime's plain decoder (llama.cpp's own loop on the same file) is the baseline of every run on it, whatever
    # the preset lists.
    always = (gen.runtime.baseline_peer,) if gen.runtime.baseline_peer else ()
    greedy, skipped = build_methods(preset.greedy + always, gen, args.k)
    sampled, skipped_sampled = build_methods(preset.sampled, gen, args.k)
    results["skipped"] = {**skipped, **skipped_sampled}
    schedule = Schedule(units, [(0.0, greedy)] + ([(SAMPLING_TEMPERATURE, sampled)] if sampled else []),
                        preset.max_new_tokens, args.seed)

    print("measuring costs (draft step, verify-cost curve) ...", file=sys.stderr)
    # The prediction for k draft tokens needs V(k+1): measure it besides the curve's widths.
    widths = VERIFY_WIDTHS + tuple(m.k + 1 for _, methods in schedule.by_temperature for m in methods
                                   if m.uses_draft_model and isinstance(m.k, int))
    others = {m.draft_model: m.generator.draft for _, methods in schedule.by_temperature for m in methods
              if getattr(m, "draft_model", None)}
    results["costs"] = measure_costs(gen.target, gen.draft, gen.vocab_size, _warm_context(units, gen, max(widths)),
                                     widths, preset.cost_reps, others)
    if preset.warmup:
        warm_up(schedule, results["skipped"])
    for spec, reason in results["skipped"].items():
        print(f"skipping {spec}: {reason}", file=sys.stderr)
    results["methods"] = _describe(schedule)
    return schedule


def _describe(schedule) -> dict:
    return {m.label: m.describe() for _, methods in schedule.by_temperature for m in methods}


def _finish(results: dict, out_dir: Path, path: Path, saved: bool) -> int:
    """Render the report of what was saved and say where it is; with nothing saved, render nothing either, so that
    an earlier run's report in out_dir keeps matching its results.json."""
    from specdec_exact.bench import report

    interrupted = results["status"] == "interrupted"
    if not saved:
        reason = "interrupted before a run finished" if interrupted else "no run finished (every method was skipped)"
        print(f"\nspecdec bench: {reason}; nothing written to {out_dir}", file=sys.stderr)
        return 130 if interrupted else 1
    markdown = report.render(results, out_dir)
    if interrupted:
        done = results.get("progress", {})
        print(f"\nspecdec bench: interrupted after {done.get('prompts_done', 0)} of {done.get('prompts_total', '?')} "
              f"prompts; {len(results['records'])} finished runs kept in {path}, report in {markdown}",
              file=sys.stderr)
        return 130
    print("\n".join(report.results_table(report.summarise(results), 0.0)))
    print(f"\nresults: {path}\nreport:  {markdown} ({results['wall_s']:.0f} s)")
    return 0


def _units(gen, candidates, preset, chat: bool) -> list:
    """Tokenise and pick each task's prompts, then interleave the tasks (code 0, summ. 0, maths 0, code 1, ...) so an
    interrupted run still covers every task."""
    import torch

    from specdec_exact.bench.runner import Unit
    from specdec_exact.bench.workloads import select

    ids = {}

    def n_tokens(prompt) -> int:
        if prompt not in ids:
            ids[prompt] = torch.tensor([gen.encode(prompt.text, chat)])  # [1, n]
        return ids[prompt].shape[1]

    per_task = [select(iter(prompts), preset.prompts_per_task, n_tokens, preset.max_prompt_tokens, prefer_long)
                for prompts, prefer_long in candidates.values()]
    ordered = [p for round_ in range(preset.prompts_per_task) for task in per_task if round_ < len(task)
               for p in [task[round_]]]
    return [Unit(i, prompt, ids[prompt]) for i, prompt in enumerate(ordered)]


def _warm_context(units, gen, widest: int):
    """WARM_CONTEXT real prompt tokens (repeated if the prompts are short) for the timed passes to follow, within the
    target's context."""
    import torch

    from specdec_exact.bench.costs import WARM_CONTEXT
    length = max(1, min(WARM_CONTEXT, gen.context_length - widest - 1))
    tokens = torch.cat([u.ids for u in units], dim=1)  # [1, total]
    return tokens.repeat(1, -(-length // tokens.shape[1]))[:, :length]
