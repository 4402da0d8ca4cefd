"""Upstream llama-server as a subprocess: where `make llama-server` built it, its command line, started on a free
loopback port and awaited until it is ready, stopped however the block ends.

The baseline that `specdec-exact generate --compare` and `specdec-exact bench`'s llama-server peer measure against; the
lab's benchmarks (benchmarks/ in the source checkout) start every server they compare, specdec-exact serve included,
through ServerProcess too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec_exact import registry

PORT = "{port}"  # stands for the server's port in its command line
CONTEXT = 4096  # llama-server's -c per slot: room for the longest prompt and answer, as specdec's own context allows
NATIVE = Path(__file__).resolve().parents[1] / "native"  # the source checkout's native/: absent from a wheel
# llama-server repacks the weights for the CPU by default; on an Intel Xeon with AMX (in a VM) its AMX matrix kernel
# crashes at the first pass (a general protection fault in ggml_backend_amx_mul_mat, seen at startup), so there a
# user runs it with the plain layout.
LLAMA_SERVER_FALLBACK = ("--no-repack",)


@dataclass(frozen=True)
class ServerCommand:
    """A server's command line (PORT for its port) and environment."""
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment
    # Arguments added for a second start when the first one crashed (was killed by a signal) before it was ready:
    # what a user of that CPU must add to run the server at all.
    fallback: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        return [word.replace(PORT, str(port)) for word in self.argv]


def openai_module():
    """The openai client, with which generate --compare and the lab's benchmarks talk to the servers they start (an
    optional extra: `bench`)."""
    try:
        import openai
    except ImportError:
        raise ValueError("the server benchmarks talk to the servers with the openai client, which is not installed: "
                         "pip install 'specdec-exact[bench]'") from None
    return openai


def default_llama_server() -> Path:
    """Where `make llama-server` builds the binary, keyed as the Makefile keys it: the CPU's flags line, the
    llama-cpp-python version and the build script."""
    script = NATIVE / "build-llama-server.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing (not a source checkout): pass --llama-server PATH")
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        pass
    cpu_key = hashlib.md5(flags.encode()).hexdigest()[:12]
    script_key = hashlib.md5(script.read_bytes()).hexdigest()[:8]
    return registry.cache_root() / "llama-server" / f"{cpu_key}-{llama_cpp_version()}-{script_key}" / "llama-server"


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, whose vendored llama.cpp source `make llama-server` builds."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def llama_server_argv(binary: Path, gguf: str, threads: int, *extra: str, slots: int = 1) -> tuple[str, ...]:
    """llama-server's command line on a GGUF file with `slots` requests at once (-np), these extra arguments after."""
    # -c is shared among the -np slots: CONTEXT tokens each
    return (str(binary), "-m", gguf, "-t", str(threads), "-c", str(CONTEXT * slots), "-np", str(slots),
            "--host", "127.0.0.1", "--port", PORT, *extra)


def llama_server(name: str, binary: Path, gguf: str, threads: int) -> ServerCommand:
    """Plain llama-server (its defaults) on a GGUF file, with the fallback for CPUs where its defaults crash."""
    return ServerCommand(name, llama_server_argv(binary, gguf, threads), fallback=LLAMA_SERVER_FALLBACK)


class ServerError(RuntimeError):
    """A server exited, or did not become ready in time."""


class ServerProcess:
    """A server as a subprocess on a free loopback port: started, awaited until /health answers 200, and stopped on
    exit (terminate, then kill), whatever happened in between. Its output goes to `log`. A server that crashes (is
    killed by a signal) before it is ready is started once more with its fallback arguments, where it has some;
    `fallback` then says why (else None)."""

    def __init__(self, server: ServerCommand, log: Path, startup_timeout: float = 1800.0, stop_timeout: float = 15.0):
        self.server, self.log_path, self.startup_timeout = server, Path(log), startup_timeout
        self.stop_timeout = stop_timeout  # seconds from terminate to kill
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.fallback: str | None = None

    def __enter__(self) -> ServerProcess:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = self.server.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # a file, not a pipe: a pipe nobody reads fills up and blocks the server
        started = time.perf_counter()
        try:
            try:
                self._start()
            except ServerError:
                code = self.process.poll() if self.process is not None else None
                if not (self.server.fallback and code is not None and code < 0):
                    raise
                self.fallback = (f"{shlex.join(self.argv)} crashed at startup (signal {-code}) on this CPU: "
                                 f"started again with {shlex.join(self.server.fallback)}")
                print(f"{self.server.name}: {self.fallback}", file=sys.stderr, flush=True)
                self.argv = [*self.argv, *self.server.fallback]
                self._start()
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.perf_counter() - started
        return self

    def _start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env={**os.environ, **dict(self.server.env)})
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while True:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:  # llama-server: 503 while loading
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"{self.server.name} was not ready after {self.startup_timeout:.0f} s: "
                                  f"{shlex.join(self.argv)}\n{self.tail()}")
            time.sleep(0.25)

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ServerError(f"{self.server.name} exited with status {code}: {shlex.join(self.argv)}\n"
                              f"its last output ({self.log_path}):\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(no output)"

    def get_json(self, path: str) -> dict | None:
        """GET path -> its JSON body where it answers 200, else None."""
        import httpx

        try:
            response = httpx.get(f"{self.url}{path}", timeout=10)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def model(self) -> str:
        """The id of the model it serves, as /v1/models gives it ("default" where it does not say)."""
        return ((self.get_json("/v1/models") or {}).get("data") or [{}])[0].get("id", "default")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def llama_server_session(binary: Path, gguf: str, threads: int, prompt: str, max_tokens: int, chat: bool, log: Path):
    """Upstream llama-server (plain, its defaults) up on the target's file, warmed up on the prompt: the baseline of
    `specdec-exact generate --compare`. Yields (measure, its settings in words: "its defaults", or the fallback its
    crash on this CPU called for), where measure() -> tokens/s of one greedy request of the prompt, prefill included:
    the whole prompt, as for a new one (`cache_prompt: false`: its slot does not reuse the warm-up's). chat: a chat
    completion of the prompt as the user's message (llama-server applies the GGUF's chat template, as specdec
    applies the tokenizer's); else a completion of the prompt as it is."""
    openai = openai_module()
    server = llama_server("llama-server", binary, gguf, threads)
    with ServerProcess(server, log) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=1800)
        model = proc.model()
        settings = "its defaults" if proc.fallback is None else (
            f"its defaults and {shlex.join(server.fallback)}: its defaults crash on this CPU")

        def measure(tokens: int = max_tokens) -> float:
            cold = {"cache_prompt": False}
            started = time.perf_counter()
            if chat:  # streamed, as the lab's benchmarks ask (benchmarks/harness.py: ask), until the usage comes
                usage = None
                for chunk in client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=cold):
                    usage = chunk.usage or usage
            else:
                usage = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                                  extra_body=cold).usage
            return (usage.completion_tokens if usage is not None else 0) / (time.perf_counter() - started)

        measure(min(2, max_tokens))  # untimed warm-up
        yield measure, settings
