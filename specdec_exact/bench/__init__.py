"""`specdec-exact bench`: real-prompt workloads, every method on the same loaded models, raw results as JSON, a report.

workloads.py  prompts from pinned packages (HumanEval, XSum, ASDiv) or a JSONL file
methods.py    ours (target-only, draft model, registered drafters) and the peers (transformers', llama.cpp's,
              upstream llama-server), one `run` each
costs.py      measured draft/verify costs and the speed-up they predict (Leviathan et al. 2023)
runner.py     presets, the interleaved schedule, results saved after every prompt
report.py     summary figures, Markdown and PNG plots, from the JSON alone
command.py    the subcommand

The comparisons against other servers (servers, conversation, interleave, replicas, load, kernels) are the lab: the
source checkout's benchmarks/ (`python -m benchmarks NAME`), outside the installed package.
"""

from specdec_exact.bench.command import add_bench_parser

__all__ = ["add_bench_parser"]
