"""`specdec bench`: real-prompt workloads, every method on the same loaded models, raw results as JSON, a report.

workloads.py  prompts from pinned packages (HumanEval, XSum, ASDiv) or a JSONL file
methods.py    ours (target-only, draft model, registered drafters) and transformers' peers, one `run` each
costs.py      measured draft/verify costs and the speed-up they predict (Leviathan et al. 2023)
runner.py     presets, the interleaved schedule, results saved after every prompt
report.py     summary figures, Markdown and PNG plots, from the JSON alone
command.py    the subcommand
load.py       `specdec load`: concurrent clients against the server, one request at a time vs batched
servers.py    `specdec bench-servers`: specdec serve against upstream llama-server, each a process driven over HTTP
conversation.py  `specdec bench-conversation`: five-turn conversations with the prompt cache, without, on llama-server
interleave.py `specdec bench-interleave`: a streaming client's gaps while another client's long prompt is read
replicas.py   `specdec bench-replicas`: one specdec serve against the same app on Ray Serve replicas, concurrent clients
kernels.py    `specdec kernels`: the kernel plan of a GGUF model on this machine, every candidate's pass times
torch_exactness.py  `python -m specdec.bench.torch_exactness`: which verify widths are exact on the torch runtime
"""

from specdec.bench.command import add_bench_parser
from specdec.bench.conversation import add_bench_conversation_parser
from specdec.bench.interleave import add_bench_interleave_parser
from specdec.bench.kernels import add_kernels_parser
from specdec.bench.load import add_load_parser
from specdec.bench.replicas import add_bench_replicas_parser
from specdec.bench.servers import add_bench_servers_parser

__all__ = ["add_bench_conversation_parser", "add_bench_interleave_parser", "add_bench_parser",
           "add_bench_replicas_parser", "add_bench_servers_parser", "add_kernels_parser", "add_load_parser"]
