"""The lab: specdec against other servers and configurations, on one harness (harness.py), outside the installed
package. Run from the source checkout: `python -m benchmarks NAME [options]`, or a script as `python -m benchmarks.X`.

servers        specdec-exact serve against upstream llama-server (plain, n-gram, draft model), each a process over HTTP
conversation   five-turn conversations and agent loops: specdec's prompt cache, none, llama-server's
interleave     a streaming client's gaps while another client's long prompt is read
replicas       one specdec-exact serve against the same app on Ray Serve replicas, under concurrent clients
load           concurrent clients against the server in this process, one request at a time vs batched
kernels        the kernel plan of a GGUF model on this machine, every candidate's pass times (and KV cache settings)
torch_exactness   (python -m benchmarks.torch_exactness) which verify widths are exact on the torch runtime
api_features      (python -m benchmarks.api_features) what logprobs and JSON schemas cost, specdec and llama-server
lookup_acceptance (python benchmarks/lookup_acceptance.py) the acceptance of suffix lookup drafts on the workloads

Each writes results.json (the machine, its CPU, the versions, every record) and report.md under --out; `--report
RESULTS_JSON` renders report.md again from a finished run's results.json (servers, conversation, interleave,
replicas). The user's own benchmark, on the models they load, is `specdec-exact bench` (specdec_exact.bench).
"""
