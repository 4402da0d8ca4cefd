"""`specdec kernels`: the kernel plan a GGUF model runs on this machine, with every candidate's pass times."""

from __future__ import annotations

from pathlib import Path

from specdec.runtimes.llamacpp.kernels import LLAMA_CPP, PLAN_PREFIX


def add_kernels_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "kernels", help="show the kernel plan of a GGUF model on this machine, with every candidate's pass times",
        description="Load a model on the llama.cpp runtime (calibrating it first if this machine has not: a "
                    "minute or two) and print its weight layouts' one-token pass times, the fastest pass of every "
                    "candidate kernel at every width 1-16 after 16 cached tokens, which were exact, and the plan "
                    "it runs. --out writes the same as JSON, with the machine.")
    parser.add_argument("--target", default=None, help="registry name or .gguf file (default: the default target)")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every core)")
    parser.add_argument("--out", default=None, help="also write it all to this JSON file")
    parser.set_defaults(func=run_kernels)


def run_kernels(args) -> int:
    from specdec import registry
    from specdec.bench.runner import kernel_patch_hash, machine_info, save
    from specdec.runtimes.llamacpp import load
    from specdec.runtimes.llamacpp.layouts import choose_layouts

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
    if args.out:
        save({"command": " ".join(["specdec", "kernels", *(f"--target {args.target}".split() if args.target else [])]),
              "machine": machine_info(), "kernel_patch": kernel_patch_hash(), "model": model.path.name,
              "threads": model.threads, "repack": model.repack, "plan": model.kernel_plan.describe(),
              "calibration": found, "layouts": layouts}, Path(args.out))
        print(f"wrote {args.out}")
    return 0
