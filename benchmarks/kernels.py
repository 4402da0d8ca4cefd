"""`python -m benchmarks kernels`: the kernel plan of a GGUF model on this machine, every candidate's pass times."""

from __future__ import annotations

from pathlib import Path

from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP, PLAN_PREFIX


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "kernels", help="show the kernel plan of a GGUF model on this machine, with every candidate's pass times",
        description="Load a model on the llama.cpp runtime (calibrating it first if this machine has not: a "
                    "minute or two) and print its weight layouts' one-token pass times, the fastest pass of every "
                    "candidate kernel at every width 1-16 after 16 cached tokens, which were exact, and the plan "
                    "it runs. --out writes the same as JSON, with the machine.")
    parser.add_argument("--target", default=None, help="registry name or .gguf file (default: the default target)")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every core)")
    parser.add_argument("--out", default=None, help="also write it all to this JSON file")
    parser.add_argument("--kv-caches", action="store_true",
                        help="also time the KV cache settings (q8_0; f16, specdec's, with ggml's split attention "
                             "off; f16 with it on, as llama.cpp is released): a --prompt-tokens prompt and one-token "
                             "passes after 16, 600, 2000 and 4000 cached tokens (those below --prompt-tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=4096,
                        help="the prompt --kv-caches times (default: %(default)s)")
    parser.set_defaults(func=run_kernels)


KV_SETTINGS = (("q8_0", False), ("f16", False), ("f16", True))  # (cache type, whether one-token passes split attention)
KV_CONTEXTS = (16, 600, 2000, 4000)  # cached tokens before the timed one-token passes


def time_kv_caches(model, prompt_tokens: int, repeats: int = 7) -> dict:
    """Each KV cache setting on model's file and threads: the seconds of a prompt_tokens prompt (prefilled as every
    prompt is, in its blocks) and the median one-token pass after each of KV_CONTEXTS below it, settings
    interleaved, all under model's kernel plan."""
    import statistics
    import time

    from specdec_exact.runtimes.llamacpp import LlamaCppModel
    from specdec_exact.runtimes.llamacpp.calibration import private_runner, probe_tokens

    contexts = [c for c in KV_CONTEXTS if c < prompt_tokens]
    models = {kind: LlamaCppModel(model.path, model.threads, kv_cache=kind) for kind in dict(KV_SETTINGS)}
    for loaded in models.values():  # the same matrix kernels in all: what differs is the attention over the cache
        loaded._kernel_plan = model.kernel_plan
    tokens = probe_tokens(model, prompt_tokens + 1)
    runners = {kind: private_runner(loaded, prompt_tokens + 1) for kind, loaded in models.items()}
    prompt_s = {}
    for kind, runner in runners.items():
        started = time.perf_counter()
        runner.forward(tokens[:, :prompt_tokens], last_only=True)
        prompt_s[kind] = time.perf_counter() - started
    one_token = {(kind, split, c): [] for kind, split in KV_SETTINGS for c in contexts}
    for _ in range(repeats):
        for c in contexts:
            for kind, split in KV_SETTINGS:
                models[kind].attention_split = split
                runners[kind].rollback(c)
                started = time.perf_counter()
                runners[kind].forward(tokens[:, c:c + 1])
                one_token[(kind, split, c)].append(time.perf_counter() - started)
    models["f16"].attention_split = False
    return {"prompt_tokens": prompt_tokens, "prompt_s": prompt_s, "contexts": contexts,
            "one_token_ms": {_kv_name(kind, split): [1e3 * statistics.median(one_token[(kind, split, c)])
                                                     for c in contexts] for kind, split in KV_SETTINGS}}


def _kv_name(kind: str, split: bool) -> str:
    return f"{kind}, attention split" if split else kind


def print_kv_caches(found: dict) -> None:
    contexts = " / ".join(map(str, found["contexts"]))
    print(f"KV cache                 prompt of {found['prompt_tokens']} tokens    one-token pass (ms) after {contexts} "
          "cached tokens")
    for kind, split in KV_SETTINGS:
        name = _kv_name(kind, split)
        prompt = f"{found['prompt_s'][kind]:7.1f} s ({found['prompt_tokens'] / found['prompt_s'][kind]:5.1f} tokens/s)"
        print(f"{name:<24} {prompt if not split else '(its prompt: as f16)':<27} "
              + " / ".join(f"{ms:.1f}" for ms in found["one_token_ms"][name]))


def run_kernels(args) -> int:
    from specdec_exact import registry
    from specdec_exact.bench.runner import kernel_patch_hash, machine_info, save, versions
    from specdec_exact.runtimes.llamacpp import load
    from specdec_exact.runtimes.llamacpp.layouts import choose_layouts

    model, _ = load(args.target or registry.DEFAULT_TARGET, threads=args.threads)
    found = model.kernel_calibration
    layouts = choose_layouts(model.path, model.threads, details=True)
    names = list(found["pass_s"]["1"])
    one = found["pass_s"]["1"][LLAMA_CPP.describe()]
    print(f"{model.path.name}, {model.threads} threads, {'repacked' if model.repack else 'plain'} weight layout; "
          f"fastest pass of each candidate after {PLAN_PREFIX} cached tokens, ms (x: over llama.cpp's own one-token "
          "pass; *: every token's logits equal its one-token pass)")
    print("width  " + "  ".join(f"{name:>24}" for name in names))
    for width, by_kernel in found["pass_s"].items():
        cells = [f"{by_kernel[name] * 1e3:7.1f} {by_kernel[name] / one:5.2f}x{'*' if name in found['exact'][width] else ' '}"
                 for name in names]
        print(f"{width:>5}  " + "  ".join(f"{cell:>24}" for cell in cells))
    print(f"plan: {model.kernel_plan.describe()}")
    if layouts.get("one_token_s_by_kernel"):
        for layout, by_kernel in layouts["one_token_s_by_kernel"].items():
            print(f"one-token pass, {layout} layout: " + ", ".join(f"{name} {s * 1e3:.1f} ms"
                                                               for name, s in by_kernel.items()))
    kv_caches = None
    if args.kv_caches:
        if args.prompt_tokens < 2:
            raise SystemExit(f"--prompt-tokens must be at least 2, got {args.prompt_tokens}")
        print(f"timing the KV cache settings ({args.prompt_tokens}-token prompt, then one-token passes) ...")
        kv_caches = time_kv_caches(model, args.prompt_tokens)
        print_kv_caches(kv_caches)
    if args.out:
        command = ["python", "-m", "benchmarks", "kernels", *(f"--target {args.target}".split() if args.target else []),
                   *(["--kv-caches", "--prompt-tokens", str(args.prompt_tokens)] if args.kv_caches else [])]
        save({"command": " ".join(command),
              "machine": machine_info(), "versions": versions(), "kernel_patch": kernel_patch_hash(),
              "model": model.path.name,
              "threads": model.threads, "repack": model.repack, "plan": model.kernel_plan.describe(),
              "calibration": found, "layouts": layouts, "kv_caches": kv_caches}, Path(args.out))
        print(f"wrote {args.out}")
    return 0
