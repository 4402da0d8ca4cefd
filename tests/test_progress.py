"""specdec_exact.progress: long steps logged with how far they are and their ETA, and readable while they run."""

from __future__ import annotations

import logging

import pytest

from specdec_exact import progress


def messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "specdec.progress"]


def test_a_step_logs_its_start_its_pace_and_its_end_and_is_current_while_it_runs(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.INFO, logger="specdec.progress")
    with progress.step("calibrating a.gguf: kernels", total=4, unit="round") as step:
        with progress.step("timing passes") as inner:
            assert [s["step"] for s in progress.current()["steps"]] == ["calibrating a.gguf: kernels",
                                                                         "timing passes"]
            assert inner.eta_s is None  # no total: no ETA
        clock[0] += 20
        step.advance()  # 1 of 4 in 20 s: 60 s left, logged (LOG_EVERY_S has passed)
        assert step.eta_s == pytest.approx(60)
        assert progress.current()["steps"] == [{"step": "calibrating a.gguf: kernels", "done": 1, "total": 4,
                                                "unit": "round", "elapsed_s": 20.0, "eta_s": 60.0}]
        clock[0] += 1
        step.advance()  # logged only every LOG_EVERY_S
        clock[0] += 19
        step.advance(2)  # the last: the end says it
    finished = progress.current()
    assert finished["steps"] == []
    assert messages(caplog) == ["calibrating a.gguf: kernels ...", "timing passes ...", "timing passes: done in 0 s",
                                "calibrating a.gguf: kernels: 1/4 rounds, 20 s so far, about 60 s left",
                                "calibrating a.gguf: kernels: done in 40 s"]


def test_each_advances_per_item_ends_where_the_loop_stops_and_a_failure_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="specdec.progress")
    seen = []
    for item in progress.each(range(5), "widths", "width"):
        seen.append(item)
        if item == 2:
            break
    assert seen == [0, 1, 2] and progress.current()["steps"] == []
    assert messages(caplog)[-1].startswith("widths: done in")
    with pytest.raises(RuntimeError):
        with progress.step("a prefill"):
            raise RuntimeError("out of memory")
    assert messages(caplog)[-1].startswith("a prefill: stopped after") and "RuntimeError" in messages(caplog)[-1]
    assert progress.current()["steps"] == []
