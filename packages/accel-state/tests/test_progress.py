"""Progress bars: on a terminal only, never in logs, silenced by ACCEL_DISABLE_PROGRESS_BAR."""

from __future__ import annotations

import io
import sys

import pytest

from accel_state import progress
from accel_state.progress import progress_bar, progress_enabled


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(total: int = 3) -> float:
    with progress_bar(total, "Loading things", "thing") as bar:
        for _ in range(total):
            bar.update(1)
    return float(getattr(bar, "n", -1))


def test_a_terminal_shows_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR", raising=False)
    assert progress_enabled()
    assert _run() == 3
    shown = terminal.getvalue()
    assert "Loading things" in shown and "/3 " in shown


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_the_flag_hides_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("ACCEL_DISABLE_PROGRESS_BAR", value)
    assert not progress_enabled()
    assert _run() == 3  # the stand-in still counts
    assert terminal.getvalue() == ""


def test_a_log_file_or_pipe_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()  # not a terminal: a redirected stderr, a CI log
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR", raising=False)
    assert not progress_enabled()
    _run()
    assert stream.getvalue() == ""


def test_processes_other_than_the_local_main_stay_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR", raising=False)
    monkeypatch.setattr(progress, "_is_local_main_process", lambda: False)
    _run()
    assert terminal.getvalue() == ""


def test_a_bad_flag_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setenv("ACCEL_DISABLE_PROGRESS_BAR", "sometimes")
    with pytest.raises(ValueError, match="ACCEL_DISABLE_PROGRESS_BAR"):
        progress_enabled()


def test_without_tqdm_nothing_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR", raising=False)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert _run() == 3
    assert terminal.getvalue() == ""
