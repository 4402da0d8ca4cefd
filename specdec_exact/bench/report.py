"""The report, rendered from the results JSON alone (no models): summary figures, a Markdown file and PNG plots.

Definitions (every figure below is derived from the raw records here and nowhere else):
  tokens/s            new tokens / wall time of the generate call, prefill included, pooled over prompts
  speed-up (median)   median over prompts of (method tokens/s) / (target-only tokens/s on the same prompt)
  speed-up (pooled)   (total tokens / total time of the method) / (the same for target-only), same prompts
  decode speed-up     the pooled ratio without prefill time (ours only: the engine times its prefill); the
                      prediction models decoding cycles only, so it is compared with this one
"""

from __future__ import annotations

import shlex
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from specdec_exact.bench.costs import predicted_speedup
from specdec_exact.bench.runner import pyplot
from specdec_exact.metrics import per_token_acceptance
from specdec_exact.metrics import SpecStats

ALL_TASKS = "all"
PLOTS = {"speedup": "speedup.png", "acceptance": "acceptance_by_position.png",
         "prediction": "predicted_vs_measured.png", "verify": "verify_cost.png"}


def pooled_stats(stats_records: list[dict]) -> SpecStats:
    """One SpecStats holding the sums of several generations' stats (as saved by runner.stats_record)."""
    total = SpecStats()
    for s in stats_records:
        for name in ("target_calls", "draft_calls", "cycles", "drafted_tokens", "accepted_tokens", "new_tokens"):
            setattr(total, name, getattr(total, name) + s[name])
        total.emitted_per_cycle.update(Counter({int(n): c for n, c in s["emitted_per_cycle"].items()}))
        for mine, theirs in ((total.drafted_by_position, s["drafted_by_position"]),
                             (total.accepted_by_position, s["accepted_by_position"])):
            mine += [0] * (len(theirs) - len(mine))
            for i, count in enumerate(theirs):
                mine[i] += count
        for name, counts in s.get("by_drafter", {}).items():  # absent from results saved before it was recorded
            mine = total.by_drafter.setdefault(name, [0, 0, 0])
            for i, key in enumerate(("cycles", "drafted_tokens", "accepted_tokens")):
                mine[i] += counts[key]
        times = s["time_s"]
        total.prefill_s += times["prefill"]
        total.draft_s += times["draft"]
        total.verify_s += times["verify"]
        total.total_s += times["total"]
    return total


def _decode_s(record: dict) -> float:
    times = record["stats"]["time_s"]
    return times["total"] - times["prefill"]


def summarise(results: dict) -> list[dict]:
    """One row per (temperature, task, method), task "all" pooling every task; rows in run order."""
    records = [r for r in results["records"] if "error" not in r]
    baseline = {(r["temperature"], r["prompt_index"]): r for r in records if r["method"] == "target-only"}
    groups = defaultdict(list)
    for r in records:
        groups[(r["temperature"], r["task"], r["method"])].append(r)
        groups[(r["temperature"], ALL_TASKS, r["method"])].append(r)
    tasks = list(dict.fromkeys(r["task"] for r in records)) + [ALL_TASKS]
    methods = list(dict.fromkeys(r["method"] for r in records))
    order = {(t, task, m): (t, tasks.index(task), methods.index(m)) for t, task, m in groups}
    rows = [_row(key, groups[key], baseline, results) for key in sorted(groups, key=order.__getitem__)]
    _add_plain_llama_cpp(rows)
    return rows


# plain decoding: ours, llama.cpp's own loop and upstream llama-server on the same file
PLAIN = ("target-only", "llama-generate", "llama-server")


def _add_plain_llama_cpp(rows: list[dict]) -> None:
    """Where llama.cpp's own loop ran: each row's pooled tokens/s over the faster plain decoder of its task."""
    for row in rows:
        row["over_plain"] = None
    if not any(r["method"] in PLAIN[1:] for r in rows):
        return
    for group in {(r["temperature"], r["task"]) for r in rows}:
        members = [r for r in rows if (r["temperature"], r["task"]) == group]
        plain = max((r["tokens_per_s"] or 0.0 for r in members if r["method"] in PLAIN), default=0.0)
        for row in members:
            row["over_plain"] = _ratio(row["tokens_per_s"], plain)


def _row(key, runs: list[dict], baseline: dict, results: dict) -> dict:
    temperature, task, method = key
    info = results.get("methods", {}).get(method, {})
    paired = [(r, baseline[(temperature, r["prompt_index"])]) for r in runs
              if (temperature, r["prompt_index"]) in baseline]
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in paired if b["tokens_per_s"] > 0]
    row = {"temperature": temperature, "task": task, "method": method, "family": info.get("family"),
           "k": info.get("k"), "prompts": len(runs), "new_tokens": sum(r["new_tokens"] for r in runs),
           "tokens_per_s": _rate(runs, lambda r: r["wall_s"]),
           "cpu_share": _cpu_share(runs, _compute_threads(results)),
           "speedup_median": statistics.median(ratios) if ratios else None,
           "speedup_pooled": _ratio(_rate([r for r, _ in paired], lambda r: r["wall_s"]),
                                    _rate([b for _, b in paired], lambda r: r["wall_s"])) if paired else None,
           "identical": None, "acceptance_rate": None, "mean_accepted_length": None, "acceptance_by_position": None,
           "per_token_acceptance": None, "decode_speedup": None}
    if temperature == 0 and method != "target-only":
        checked = [r["identical"] for r in runs if r.get("identical") is not None]
        row["identical"] = [sum(checked), len(checked)] if checked else None
    with_stats = [r for r in runs if r.get("stats")]
    if with_stats and method != "target-only":
        stats = pooled_stats([r["stats"] for r in with_stats])
        row["by_drafter"] = stats.by_drafter
        row.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                   acceptance_by_position=stats.acceptance_by_position,
                   per_token_acceptance=per_token_acceptance(stats))
        decode_pairs = [(r, b) for r, b in paired if r.get("stats") and b.get("stats")]
        if decode_pairs:
            row["decode_speedup"] = _ratio(_rate([r for r, _ in decode_pairs], _decode_s),
                                           _rate([b for _, b in decode_pairs], _decode_s))
    row.update(_prediction(row, info, results.get("costs")))
    return row


def _compute_threads(results: dict) -> int | None:
    machine = results.get("machine", {})
    return machine.get("compute_threads") or machine.get("torch_threads")


def _cpu_share(runs: list[dict], threads: int | None) -> float | None:
    """CPU seconds we got / (wall seconds x torch threads): well below 1 means other processes took the cores."""
    if not threads or any("cpu_s" not in r for r in runs):
        return None
    return sum(r["cpu_s"] for r in runs) / (threads * sum(r["wall_s"] for r in runs))


def _rate(runs: list[dict], seconds) -> float | None:
    total = sum(seconds(r) for r in runs)
    return sum(r["new_tokens"] for r in runs) / total if total > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _prediction(row: dict, info: dict, costs: dict | None) -> dict:
    """Leviathan et al.'s predicted speed-up for a draft model at a fixed k (see specdec_exact.bench.costs)."""
    empty = {"c": None, "verify_ratio": None, "predicted_tokens_per_cycle": None, "predicted_speedup": None,
             "measured_over_predicted": None}
    k, a = info.get("k"), row["per_token_acceptance"]
    c = (costs or {}).get("c_by_draft", {}).get(info["draft_model"]) if info.get("draft_model") else (costs or {}).get(
        "c")
    if not info.get("uses_draft_model") or not isinstance(k, int) or a is None or c is None:
        return empty
    verify_ratio = costs["verify_ratio"].get(str(k + 1))
    if verify_ratio is None:
        return empty
    predicted = predicted_speedup(a, k, c, verify_ratio)
    return {"c": c, "verify_ratio": verify_ratio,
            "predicted_tokens_per_cycle": predicted * (k * c + verify_ratio),
            "predicted_speedup": predicted, "measured_over_predicted": _ratio(row["decode_speedup"], predicted)}


# --- Markdown ---------------------------------------------------------------------------------------------------------


def _f(value, digits: int = 2, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def results_table(rows: list[dict], temperature: float) -> list[str]:
    rows = [r for r in rows if r["temperature"] == temperature]
    cpu = any(r["cpu_share"] is not None for r in rows)  # absent from results saved before it was recorded
    plain = any(r.get("over_plain") is not None for r in rows)
    body = []
    for r in rows:
        identical = f"{r['identical'][0]}/{r['identical'][1]}" if r["identical"] else "—"
        body.append([r["task"], r["method"], str(r["prompts"]), _f(r["tokens_per_s"]), _f(r["speedup_median"], 2, "x"),
                     _f(r["speedup_pooled"], 2, "x")] + ([_f(r["over_plain"], 2, "x")] if plain else [])
                    + [_f(r["acceptance_rate"], 2), _f(r["mean_accepted_length"], 2)]
                    + ([identical] if temperature == 0 else []) + ([_f(r["cpu_share"], 2)] if cpu else []))
    header = (["task", "method", "prompts", "tokens/s", "speed-up (median)", "speed-up (pooled)"]
              + (["over plain llama.cpp (pooled)"] if plain else []) + ["acceptance", "mean accepted length"]
              + (["identical to target-only"] if temperature == 0 else []))
    return _table(header + (["CPU share"] if cpu else []), body)


def markdown(results: dict, rows: list[dict], plots: dict[str, str]) -> str:
    settings, machine, preset = results["settings"], results["machine"], results["preset"]
    progress = results.get("progress", {})
    status = results["status"]
    if status != "complete":
        status += f" after {progress.get('prompts_done', 0)} of {progress.get('prompts_total', '?')} prompts"
    lines = [
        "# specdec benchmark", "",
        f"Command: `{shlex.join(results['command'])}`  ",
        f"Status: {status}; wall time {_f(results.get('wall_s'), 0, ' s')}  ",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {_compute_threads(results)} compute threads, "
        f"{machine.get('ram_gb')} GB RAM, {machine['platform']}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in machine['load_average_at_start'])}"
        + (f", at end {', '.join(f'{x:.2f}' for x in machine['load_average_at_end'])}"
           if machine.get("load_average_at_end") else "") + "  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v) + "  ",
        f"Target: {settings['target']}; draft: {settings['draft']}; runtime {settings.get('runtime', 'torch')}"
        + (", weights as in the GGUF files" if settings.get("runtime") == "llama.cpp" else
           f", dtype {settings['dtype']}, target quantization {settings.get('quantize_target') or 'none'}, draft "
           f"quantization {settings.get('quantize_draft')}") + "  ",
        f"Preset {preset['name']}: up to {preset['prompts_per_task']} prompt(s) per task of at most "
        f"{preset['max_prompt_tokens']} tokens, {preset['max_new_tokens']} new tokens; temperature 0 (greedy) and "
        f"{settings['sampling_temperature']} (seed {settings['seed']} + prompt index, the same for every method); "
        f"methods run interleaved prompt by prompt", "",
        "tokens/s: new tokens / wall time of the call, prefill included. Speed-up (median): median over prompts of "
        "the ratio to target-only on the same prompt; (pooled): total tokens / total time, over target-only's. "
        "Acceptance: accepted / drafted tokens. Mean accepted length: tokens per verify cycle, the recovered or bonus "
        "token included. CPU share: CPU seconds the run got / (wall seconds x compute threads); well below 1 means "
        "other processes took the cores and the timings of that row are inflated. Over plain llama.cpp (where "
        "llama-server or llama-generate ran): pooled tokens/s over the fastest of target-only, llama-server and "
        "llama-generate on the same prompts.", "",
    ]
    for temperature in dict.fromkeys(r["temperature"] for r in rows):
        title = "greedy" if temperature == 0 else "sampling"
        lines += [f"## Temperature {temperature:g} ({title})", "", *results_table(rows, temperature), ""]
        if temperature == 0:
            lines += ["Greedy speculative decoding must reproduce target-only token for token; a difference means a "
                      "numerical near-tie flipped by the batch shape of a verify pass, or a bug. hf-generate is the "
                      "sanity check of the timing: it does what target-only does, so a speed-up far from 1.00x there "
                      "measures machine drift (or per-token overhead), not a method.", ""]
    peers = [f"- {label}: {info['loaded_as']}" for label, info in results.get("methods", {}).items()
             if info.get("loaded_as")]
    if peers:
        lines += ["How the peers loaded the model (each in a worker process of its own, so its CPU share is not "
                  "measured; with llama.cpp's default settings: an f16 KV cache, no flash attention, repacked weight "
                  "layouts, so its tokens may differ slightly from ours):", "", *peers, ""]
    lines += _drafter_section(rows)
    lines += _costs_section(results.get("costs"))
    lines += _prediction_section(rows)
    lines += _position_section(rows)
    lines += ["## Memory", "", "Peak resident memory (ru_maxrss): after loading the models "
              f"{_f(results['memory'].get('after_load_mb'), 0, ' MB')} (weights are memory-mapped: pages count once "
              f"touched), whole run {_f(results['memory'].get('peak_rss_mb'), 0, ' MB')}.", ""]
    problems = [f"- {method}: {reason}" for method, reason in results.get("skipped", {}).items()]
    problems += [f"- {r['method']} on prompt {r['prompt_index']} (T={r['temperature']:g}): {r['error']}"
                 for r in results["records"] if "error" in r]
    if problems:
        lines += ["## Skipped or failed", "", *problems, ""]
    if plots:
        lines += ["## Plots", "", *(f"![{name}]({file})" for name, file in plots.items()), ""]
    return "\n".join(lines)


def _drafter_section(rows: list[dict]) -> list[str]:
    """Who drafted, for methods that choose per cycle (several drafters in one run)."""
    body = []
    for r in rows:
        shares = r.get("by_drafter") or {}
        if len(shares) > 1 or set(shares) == {"none"}:  # a per-cycle choice (even if it always chose plain steps)
            body.append([f"{r['temperature']:g}", r["task"], r["method"], "; ".join(
                f"{name}: {c} cycles, {a}/{d} accepted" if d else f"{name}: {c} cycles"
                for name, (c, d, a) in sorted(shares.items()))])
    if not body:
        return []
    return ["## Who drafted", "", "Cycles by the option chosen (suffix lookup, the draft model, or none: a plain "
            "step), with the draft tokens each got accepted.", "",
            *_table(["T", "task", "method", "cycles by drafter"], body), ""]


def _costs_section(costs: dict | None) -> list[str]:
    if not costs:
        return []
    rows = [[w, _f(costs["target_pass_median_s"][w], 3), _f(costs["verify_ratio"][w], 2)]
            for w in costs["verify_ratio"]]
    c = "—" if costs.get("c") is None else f"{costs['c']:.3f} ({costs['draft_step_median_s']:.3f} s per draft step)"
    c += "".join(f"; {name}: {value:.3f}" for name, value in costs.get("c_by_draft", {}).items())
    return ["## Measured costs", "",
            f"Median of {costs['reps']} timed passes each after a warm cache of {costs['context_tokens']} tokens. "
            f"Cost ratio c (one draft step / one target step): {c}.", "",
            *_table(["new tokens in one target pass", "seconds", "V(w) / V(1)"], rows), ""]


def _prediction_section(rows: list[dict]) -> list[str]:
    predicted = [r for r in rows if r["predicted_speedup"] is not None]
    if not predicted:
        return []
    body = [[f"{r['temperature']:g}", r["task"], r["method"], str(r["k"]), _f(r["per_token_acceptance"]), _f(r["c"], 3),
             _f(r["verify_ratio"]), _f(r["predicted_tokens_per_cycle"]), _f(r["mean_accepted_length"]),
             _f(r["predicted_speedup"], 2, "x"), _f(r["decode_speedup"], 2, "x"), _f(r["measured_over_predicted"])]
            for r in predicted]
    return ["## Predicted vs measured speed-up", "",
            "Leviathan et al. 2023 with measured costs: expected tokens per cycle E = (1 - a^(k+1)) / (1 - a) and "
            "predicted speed-up E / (k c + V(k+1)/V(1)), where a is the per-token acceptance (accepted draft tokens / "
            "tested ones: each cycle tests up to its first rejection), c the cost ratio and V the verify-cost curve "
            "above. The paper's E / (k c + 1) assumes a pass over k+1 tokens costs one over one token; the measured "
            "V(k+1)/V(1) replaces that 1. Measured: the decode speed-up (prefill excluded, as in the model).", "",
            *_table(["T", "task", "method", "k", "a", "c", "V(k+1)/V(1)", "E predicted", "E measured",
                     "predicted", "measured", "measured / predicted"], body), ""]


def _position_section(rows: list[dict]) -> list[str]:
    shown = [r for r in rows if r["task"] == ALL_TASKS and r["acceptance_by_position"]]
    if not shown:
        return []
    width = max(len(r["acceptance_by_position"]) for r in shown)
    body = [[f"{r['temperature']:g}", r["method"]] + [_f(x) for x in r["acceptance_by_position"]]
            + [""] * (width - len(r["acceptance_by_position"])) for r in shown]
    return ["## Acceptance by draft position (all tasks)", "",
            "Fraction of cycles that drafted position i whose draft tokens 1..i were all accepted.", "",
            *_table(["T", "method"] + [str(i + 1) for i in range(width)], body), ""]


# --- plots ------------------------------------------------------------------------------------------------------------


def plot(results: dict, rows: list[dict], out_dir: Path) -> dict[str, str]:
    """Write the PNGs that have data; -> {title: file name} (none where matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        return {}
    from matplotlib.ticker import MaxNLocator

    written = {}
    compared = [r for r in rows if r["method"] != "target-only" and r["speedup_median"] is not None]
    if compared:
        temperatures = list(dict.fromkeys(r["temperature"] for r in compared))
        fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
        for ax, temperature in zip(axes[0], temperatures):
            here = [r for r in compared if r["temperature"] == temperature]
            tasks = list(dict.fromkeys(r["task"] for r in here))
            methods = list(dict.fromkeys(r["method"] for r in here))
            width = 0.8 / max(1, len(methods))
            for j, method in enumerate(methods):
                values = {r["task"]: r["speedup_median"] for r in here if r["method"] == method}
                ax.bar([i + j * width for i in range(len(tasks))], [values.get(t, 0) for t in tasks], width,
                       label=method)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(tasks))], tasks)
            ax.set_ylabel("speed-up over target-only (median)")
            ax.set_title(f"temperature {temperature:g}")
            ax.legend(fontsize="small")
        written["speed-up per task and method"] = _save(fig, out_dir, PLOTS["speedup"], plt)
    positional = [r for r in rows if r["task"] == ALL_TASKS and r["acceptance_by_position"]]
    if positional:
        temperatures = list(dict.fromkeys(r["temperature"] for r in positional))
        fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
        for ax, temperature in zip(axes[0], temperatures):
            for r in (r for r in positional if r["temperature"] == temperature):
                positions = range(1, len(r["acceptance_by_position"]) + 1)
                ax.plot(positions, r["acceptance_by_position"], marker="o", label=r["method"])
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("draft position")
            ax.set_ylabel("P(draft tokens 1..i accepted)")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"temperature {temperature:g}, all tasks")
            ax.legend(fontsize="small")
        written["acceptance by draft position"] = _save(fig, out_dir, PLOTS["acceptance"], plt)
    predicted = [r for r in rows if r["measured_over_predicted"] is not None]
    if predicted:
        fig, ax = plt.subplots(figsize=(6, 5))
        series = list(dict.fromkeys((r["method"], r["temperature"]) for r in predicted))
        for i, (method, temperature) in enumerate(series):
            here = [r for r in predicted if (r["method"], r["temperature"]) == (method, temperature)]
            color = f"C{i % 10}"
            for r in here:  # the pooled point large and labelled, each task small
                pooled = r["task"] == ALL_TASKS
                ax.scatter(r["predicted_speedup"], r["decode_speedup"], color=color, s=70 if pooled else 18,
                           marker="*" if pooled else "o", label=f"{method} T={temperature:g}" if pooled else None)
        top = max(max(r["predicted_speedup"], r["decode_speedup"]) for r in predicted) * 1.1
        ax.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=0.8, label="measured = predicted")
        ax.set_xlabel("predicted speed-up (Leviathan et al., measured a, c, V)")
        ax.set_ylabel("measured decode speed-up")
        ax.set_title("stars: all tasks pooled; dots: one task each", fontsize="small")
        ax.legend(fontsize="small")
        written["measured vs predicted speed-up"] = _save(fig, out_dir, PLOTS["prediction"], plt)
    costs = results.get("costs")
    if costs:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        widths = [int(w) for w in costs["verify_ratio"]]
        ax.plot(widths, list(costs["verify_ratio"].values()), marker="o", label="target pass over w tokens")
        if costs.get("c") is not None:
            ax.axhline(costs["c"], color="grey", linestyle="--", label=f"one draft step (c = {costs['c']:.2f})")
        ax.set_xlabel("new tokens in one pass (w)")
        ax.set_ylabel("cost / one target step")
        ax.legend(fontsize="small")
        written["verify-cost curve"] = _save(fig, out_dir, PLOTS["verify"], plt)
    return written


def _save(fig, out_dir: Path, name: str, plt) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def render(results: dict, out_dir: str | Path) -> Path:
    """Write report.md and the plots into out_dir; -> the Markdown file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarise(results)
    plots = plot(results, rows, out_dir)
    path = out_dir / "report.md"
    path.write_text(markdown(results, rows, plots))
    return path
