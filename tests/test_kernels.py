"""The kernel plan (runtimes.llamacpp.kernels): its C-level exactness test, the choice it makes, and the calibration cache keys
that keep what was measured under one set of kernels from being read under another."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import require
from specdec_exact.runtimes.llamacpp import kernels
from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP, MAX_WIDTH, MULTI_COLUMN, WIDE, Kernel, KernelPlan

NATIVE = Path(__file__).resolve().parent.parent / "native"


@pytest.fixture(scope="module")
def kernel_test(tmp_path_factory) -> Path:
    """native/test-kernel-plan.c compiled against the installed llama.cpp libraries and the headers that the wheel
    build keeps beside the wheel (the Makefile names their folder in SPECDEC_GGML_INCLUDE)."""
    from specdec_exact.runtimes import llamacpp

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the multi-column kernels are x86 code; elsewhere every plan is llama.cpp's own")
    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    include = os.environ.get("SPECDEC_GGML_INCLUDE", "")
    require(bool(include) and (Path(include) / "ggml.h").is_file(),
             f"ggml's headers not found in SPECDEC_GGML_INCLUDE={include!r}: run the tests with `make test`, which "
             "sets it to the folder the wheel build keeps them in")
    compiler = shutil.which("cc") or shutil.which("gcc")
    require(compiler is not None, "no C compiler (cc) to build native/test-kernel-plan.c")
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    binary = tmp_path_factory.mktemp("kernels") / "test-kernel-plan"
    subprocess.run([compiler, "-O2", "-std=c11", str(NATIVE / "test-kernel-plan.c"), "-I", include, "-L", str(lib),
                    f"-Wl,-rpath,{lib}", "-lggml", "-lggml-base", "-lggml-cpu", "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    return binary


@pytest.mark.parametrize("layout", ["plain", "repacked"])
def test_every_kernel_variant_gives_one_column_results_bit_for_bit(kernel_test, layout):
    """Each multi-column variant (256/512-bit, each prefetch distance), at widths 1-16, Q4_K and Q6_K (plain) or Q4_K
    (repacked, the one type x86 repacks), on 1-3 threads: every column equals the column multiplied alone by
    llama.cpp's own kernels. Where llama.cpp's repacked layout crashes (its own loop did on an AMX Xeon), specdec
    runs the plain one, and that case is skipped with the signal."""
    result = subprocess.run([str(kernel_test), layout], capture_output=True, text=True, timeout=300)
    if layout == "repacked" and result.returncode < 0:
        pytest.skip(f"llama.cpp's repacked layout crashed on this CPU (signal {-result.returncode}); specdec's layout "
                    "calibration then chooses the plain one")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    passed, _, total = summary.split()[:3]
    # Q4_K and Q6_K plain; Q4_K repacked where the CPU repacks it
    cases = (2 if layout == "plain" else 1) - result.stdout.count("skipped")
    variants = len(kernels.candidates()) - 1  # every multi-column variant built for this CPU
    assert passed == total and int(total) == cases * 3 * MAX_WIDTH * variants, summary  # 1-3 threads, 1-16 columns
    assert "MISMATCH" not in result.stdout


def test_negative_control_the_kernel_test_catches_one_flipped_bit(kernel_test):
    result = subprocess.run([str(kernel_test), "plain", "--flip"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "MISMATCH" in result.stdout


def test_the_plan_takes_the_fastest_exact_kernel_per_width():
    fast_inexact, slower_exact = Kernel(MULTI_COLUMN | WIDE, 16384), Kernel(MULTI_COLUMN, 0)
    seconds = {width: {LLAMA_CPP: 0.030 + 0.01 * width, fast_inexact: 0.02, slower_exact: 0.025}
               for width in range(1, MAX_WIDTH + 1)}
    exact = {width: [LLAMA_CPP, slower_exact] + ([fast_inexact] if width <= 2 else []) for width in seconds}
    exact[MAX_WIDTH] = []
    plan = kernels.choose_plan(seconds, exact)
    assert plan.kernels[:2] == (fast_inexact, fast_inexact)
    assert set(plan.kernels[2:MAX_WIDTH - 1]) == {slower_exact}  # 0.025 s, not the faster inexact one
    assert plan.kernels[MAX_WIDTH - 1] == LLAMA_CPP  # nothing exact: llama.cpp's own, and the calibration narrows
    seconds[1][LLAMA_CPP] = 0.001
    assert kernels.choose_plan(seconds, exact).kernels[0] == LLAMA_CPP  # llama.cpp's own when it is the fastest


def test_a_plan_describes_itself_in_runs_of_widths_and_survives_json():
    plan = KernelPlan((LLAMA_CPP,) + (Kernel(MULTI_COLUMN, 4096),) * 3 + (Kernel(MULTI_COLUMN | WIDE, 0),) * 12)
    assert plan.describe() == ("1: llama.cpp's own; 2-4: multi-column 256-bit, prefetch 4 KB; "
                               "5-16: multi-column 512-bit, no prefetch")
    assert KernelPlan.from_json(plan.to_json()) == plan
    assert KernelPlan.from_json(plan.to_json()).key == plan.key != KernelPlan.uniform(LLAMA_CPP).key
    with pytest.raises(ValueError, match="each width 1-16"):
        KernelPlan((LLAMA_CPP,) * 3)


def test_llama_cpps_own_kernels_are_always_a_candidate_and_the_only_one_when_switched_off(monkeypatch):
    from specdec_exact.runtimes import llamacpp

    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    monkeypatch.delenv("GGML_CPU_MULTI_COLUMN", raising=False)
    found = kernels.candidates()
    assert found[0] == LLAMA_CPP
    if platform.machine() == "x86_64":  # the patch's kernels where they are compiled, every prefetch distance
        assert {k.prefetch for k in found if k.flags & MULTI_COLUMN} == set(kernels.PREFETCH_DISTANCES)
    for off in ("0", " 0", "00", "0x1"):  # as C's atoi reads it: all of these are 0
        monkeypatch.setenv("GGML_CPU_MULTI_COLUMN", off)
        assert kernels.candidates() == [LLAMA_CPP], off
    monkeypatch.setenv("GGML_CPU_MULTI_COLUMN", "1")
    assert kernels.candidates() == found


def test_a_calibration_made_with_the_patchs_kernels_is_never_read_with_them_off(tmp_path, monkeypatch):
    """GGML_CPU_MULTI_COLUMN=0 (llama.cpp's own kernels) once read a calibration made with the patch on, which could
    verify wider than llama.cpp's own kernels are exact: the switch is part of every calibration's cache key."""
    from specdec_exact.runtimes import llamacpp

    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGML_CPU_MULTI_COLUMN", raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    measured = []

    def measure():
        measured.append(os.environ.get("GGML_CPU_MULTI_COLUMN"))
        return {"exact_width": len(measured)}

    def calibration():
        return llamacpp.calibration.cached_json(gguf, "exactness", "2|q8_0|False", measure, {})

    assert calibration() == {"exact_width": 1}
    monkeypatch.setenv("GGML_CPU_MULTI_COLUMN", "0")
    assert calibration() == {"exact_width": 2}  # measured again, not read from the patch's calibration
    monkeypatch.delenv("GGML_CPU_MULTI_COLUMN")
    assert calibration() == {"exact_width": 1}  # the first one, from the cache
    assert measured == [None, "0"]


def test_the_plan_is_set_in_the_library_that_llama_cpp_loaded():
    """The wheel holds libggml-cpu three times, as copies: a plan set in a copy that llama.cpp did not load would
    change nothing (the calibration once timed seven "candidates" that were one kernel). The library the plan goes to
    is the one mapped into the process before, and opening it maps nothing new."""
    from specdec_exact.runtimes import llamacpp

    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    llamacpp.library.library()

    def mapped() -> set[str]:
        return {line.split()[-1] for line in open("/proc/self/maps") if "/libggml-cpu" in line}

    before = mapped()
    library = kernels.loaded_library()
    assert library._name in before and mapped() == before


_CALIBRATE_SLOWLY = """
import json, sys, time
from pathlib import Path
from specdec_exact.runtimes import llamacpp

def measure():
    Path(sys.argv[2]).write_text("measuring")  # the parent starts its own calibration now
    time.sleep(3)
    return {"measured_by": "child"}

print(json.dumps(llamacpp.calibration.cached_json(Path(sys.argv[1]), "costs", "2|q8_0|False", measure, {})))
"""


def test_a_second_process_waits_for_a_calibration_in_progress_and_reads_its_result(tmp_path, monkeypatch):
    """Two servers started at once used to calibrate side by side, each timing the other's load into its cache: now
    the second waits for the first and reads what it measured, measuring nothing itself."""
    import sys
    import time

    from specdec_exact.runtimes import llamacpp

    require(llamacpp.installed(), f"llama-cpp-python is not installed: run `make setup` ({llamacpp.PIN})")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    gguf, started = tmp_path / "model.gguf", tmp_path / "started"
    gguf.write_bytes(b"GGUF")
    child = subprocess.Popen([sys.executable, "-c", _CALIBRATE_SLOWLY, str(gguf), str(started)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not started.exists():
        assert child.poll() is None and time.monotonic() < deadline, "the child never started measuring"
        time.sleep(0.05)
    measured_here = []
    found = llamacpp.calibration.cached_json(gguf, "costs", "2|q8_0|False", lambda: measured_here.append(1) or {"x": 1}, {})
    assert child.wait(timeout=120) == 0
    assert found == {"measured_by": "child"} and not measured_here
