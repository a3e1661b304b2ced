"""get_logger and MultiProcessAdapter in one process, with ranks set by hand."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from accel_state import DistributedType, MultiProcessAdapter, PartialState, get_logger

NAME = "accel_state.tests.logging"


@pytest.fixture(autouse=True)
def _restore_logging_levels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCEL_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    root = logging.getLogger()
    named = logging.getLogger(NAME)
    saved = (root.level, named.level)
    yield
    root.setLevel(saved[0])
    named.setLevel(saved[1])


class Recorder(logging.Handler):
    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.events = [] if events is None else events
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.events.append(record.getMessage())


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder()
    logger = logging.getLogger(NAME)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _hand_set(num_processes: int, process_index: int) -> None:
    PartialState()
    PartialState._shared_state.update(
        num_processes=num_processes,
        process_index=process_index,
        local_process_index=process_index,
        distributed_type=DistributedType.MULTI_CPU,
    )


def test_get_logger_returns_an_adapter_of_the_named_logger() -> None:
    adapter = get_logger(NAME)
    assert isinstance(adapter, MultiProcessAdapter)
    assert adapter.logger is logging.getLogger(NAME)


def test_logging_before_any_state_is_refused(recorder: Recorder) -> None:
    logger = get_logger(NAME, log_level="INFO")
    with pytest.raises(RuntimeError, match=r"`PartialState\(\)` or\s+`Accelerator\(\)`"):
        logger.info("too early")
    with pytest.raises(RuntimeError, match="initialize the accel state"):
        logger.error("too early")
    assert recorder.events == []


def test_single_process_logs_without_prefix(recorder: Recorder) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="INFO")
    logger.info("hello %s", "world")
    logger.debug("hidden")
    assert recorder.events == ["hello world"]


def test_record_points_at_the_caller(recorder: Recorder) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="INFO")

    def user_code() -> None:
        logger.info("where")

    user_code()
    assert recorder.records[0].funcName == "user_code"
    assert recorder.records[0].filename == "test_logging.py"


def test_main_process_only_on_the_main_process(recorder: Recorder) -> None:
    _hand_set(num_processes=2, process_index=0)
    logger = get_logger(NAME, log_level="INFO")
    logger.info("main")
    logger.info("everyone", main_process_only=False)
    assert recorder.events == ["[RANK 0] main", "[RANK 0] everyone"]


def test_main_process_only_on_another_process(recorder: Recorder) -> None:
    _hand_set(num_processes=2, process_index=1)
    logger = get_logger(NAME, log_level="INFO")
    logger.info("main")
    logger.warning("main warning")
    logger.info("everyone", main_process_only=False)
    assert recorder.events == ["[RANK 1] everyone"]


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        (0, ["[RANK 0] ordered", "barrier", "barrier", "barrier"]),
        (1, ["barrier", "[RANK 1] ordered", "barrier", "barrier"]),
        (2, ["barrier", "barrier", "[RANK 2] ordered", "barrier"]),
    ],
)
def test_in_order_logs_at_the_rank_turn(
    monkeypatch: pytest.MonkeyPatch, rank: int, expected: list[str]
) -> None:
    events: list[str] = []
    handler = Recorder(events)
    logging.getLogger(NAME).addHandler(handler)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: events.append("barrier"))
    try:
        _hand_set(num_processes=3, process_index=rank)
        get_logger(NAME, log_level="INFO").info("ordered", in_order=True)
    finally:
        logging.getLogger(NAME).removeHandler(handler)
    assert events == expected


def test_disabled_level_logs_nothing(recorder: Recorder) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="ERROR")
    logger.warning("not shown", main_process_only=False)
    logger.error("shown")
    assert recorder.events == ["shown"]


def test_warning_once(recorder: Recorder) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="INFO")
    logger.warning_once("careful")
    logger.warning_once("careful")
    logger.warning_once("other")
    assert recorder.events == ["careful", "other"]


@pytest.mark.parametrize("level", ["LOUD", "verbose", "10x"])
def test_bad_log_level(level: str) -> None:
    with pytest.raises(ValueError, match="is not a logging level") as info:
        get_logger(NAME, log_level=level)
    assert repr(level) in str(info.value)


def test_log_level_argument_is_case_insensitive() -> None:
    get_logger(NAME, log_level="debug")
    assert logging.getLogger(NAME).level == logging.DEBUG


def test_accel_log_level_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_LOG_LEVEL", "ERROR")
    get_logger(NAME)
    assert logging.getLogger(NAME).level == logging.ERROR
    # An explicit level wins.
    get_logger(NAME, log_level="INFO")
    assert logging.getLogger(NAME).level == logging.INFO


def test_bad_accel_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="ACCEL_LOG_LEVEL='chatty'"):
        get_logger(NAME)


def test_no_level_leaves_the_logger_alone() -> None:
    logging.getLogger(NAME).setLevel(logging.CRITICAL)
    get_logger(NAME)
    assert logging.getLogger(NAME).level == logging.CRITICAL
