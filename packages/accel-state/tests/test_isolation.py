"""The isolation every test suite runs under: clean_state fails a test that leaks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_state.testing import clean_state, isolation
from accel_state.testing.isolation import LeakError, restored_variables

NAME = "ACCEL_T_ISOLATION"


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "THREAD_GRACE", 0.2)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event the test's threads wait on; set after the test so none outlives it."""
    event = threading.Event()
    yield event
    event.set()


def test_a_variable_set_and_not_restored_fails_and_is_removed() -> None:
    with pytest.raises(LeakError, match=f"environment variable {NAME} set to '1'"):
        with clean_state(check_leaks=True):
            os.environ[NAME] = "1"
    assert NAME not in os.environ


def test_a_variable_changed_or_removed_fails_and_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NAME, "before")
    with pytest.raises(LeakError, match=f"{NAME} changed from 'before' to 'after'"):
        with clean_state(check_leaks=True):
            os.environ[NAME] = "after"
    assert os.environ[NAME] == "before"
    with pytest.raises(LeakError, match=f"{NAME} removed \\(it was 'before'\\)"):
        with clean_state(check_leaks=True):
            del os.environ[NAME]
    assert os.environ[NAME] == "before"


def test_a_variable_put_back_inside_the_block_is_no_leak() -> None:
    with clean_state(check_leaks=True):
        os.environ[NAME] = "1"
        del os.environ[NAME]


@pytest.mark.parametrize("daemon", [False, True], ids=["thread", "daemon"])
def test_a_thread_still_running_fails(release: threading.Event, daemon: bool) -> None:
    kind = "daemon thread" if daemon else "thread"
    with pytest.raises(LeakError, match=f"{kind} 'leaky' \\(Thread\\) still running"):
        with clean_state(check_leaks=True):
            threading.Thread(target=release.wait, name="leaky", daemon=daemon).start()


def test_a_thread_that_ends_within_the_grace_period_is_no_leak() -> None:
    stop = threading.Event()
    with clean_state(check_leaks=True):
        threading.Thread(target=stop.wait, name="short", daemon=True).start()
        threading.Timer(0.05, stop.set).start()


def test_threads_alive_before_the_block_are_ignored(release: threading.Event) -> None:
    older = threading.Thread(target=release.wait, name="older", daemon=True)
    older.start()
    with clean_state(check_leaks=True):
        pass
    assert older.is_alive()


def test_without_check_leaks_the_environment_is_restored_silently() -> None:
    with clean_state():
        os.environ[NAME] = "1"
    assert NAME not in os.environ


def test_an_exception_in_the_block_is_not_replaced_by_a_leak() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with clean_state(check_leaks=True):
            os.environ[NAME] = "1"
            raise RuntimeError("boom")
    assert NAME not in os.environ


def test_restored_variables_undoes_only_the_names_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME + "_KEPT", "old")
    monkeypatch.delenv(NAME + "_NEW", raising=False)
    with pytest.raises(KeyError):
        with restored_variables(NAME + "_KEPT", NAME + "_NEW"):
            os.environ[NAME + "_KEPT"] = "new"
            os.environ[NAME + "_NEW"] = "1"
            os.environ[NAME + "_OTHER"] = "stays"
            raise KeyError("x")
    assert os.environ[NAME + "_KEPT"] == "old"
    assert NAME + "_NEW" not in os.environ
    assert os.environ.pop(NAME + "_OTHER") == "stays"


def test_a_suite_under_the_fixture_fails_the_tests_that_leak(tmp_path: Path) -> None:
    """A real pytest run: the autouse fixture of the packages' conftest files, three tests."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from accel_state.testing import clean_state
            from accel_state.testing import isolation

            isolation.THREAD_GRACE = 0.2

            @pytest.fixture(autouse=True)
            def _clean_state():
                with clean_state(check_leaks=True):
                    yield
            """
        )
    )
    (tmp_path / "test_suite.py").write_text(
        textwrap.dedent(
            f"""
            import os
            import threading

            RELEASE = threading.Event()

            def test_clean(monkeypatch):
                monkeypatch.setenv("{NAME}", "restored by monkeypatch")

            def test_leaks_a_variable():
                os.environ["{NAME}"] = "1"

            def test_leaks_a_thread():
                threading.Thread(target=RELEASE.wait, name="leaky", daemon=True).start()

            def test_zz_sees_no_leak_from_before():
                assert "{NAME}" not in os.environ
                RELEASE.set()
            """
        )
    )
    env = {key: value for key, value in os.environ.items() if key != NAME}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    # The leaking tests pass, then error at teardown: pytest counts them under both.
    assert "4 passed, 2 errors" in output, output
    assert "ERROR test_suite.py::test_leaks_a_variable" in output, output
    assert "ERROR test_suite.py::test_leaks_a_thread" in output, output
    assert f"environment variable {NAME} set to '1'" in output, output
    assert "daemon thread 'leaky' (Thread) still running" in output, output
