"""The prefetch engine's OS paging layer, on real files and memory maps."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_bigmodel.prefetch.paging import (
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    PAGE,
    PAGER,
    FileNeed,
    Pager,
    Span,
    check_files,
    merge_spans,
    page_aligned,
    page_in_background,
)

needs_madvise = pytest.mark.skipif(
    PAGER.madvise is None or PAGER.mincore is None, reason="no madvise/mincore here"
)


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[Span]:
    """A four-page file, mapped: the span of the whole map."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as memory:
        anchor = ctypes.c_char.from_buffer(memory)
        yield Span(ctypes.addressof(anchor), 4 * PAGE, str(path))
        del anchor  # the map cannot close while a ctypes object exports it


# -- checks on the files --------------------------------------------------------------------


def test_check_files_names_a_missing_or_shrunk_file(tmp_path: Path) -> None:
    path = tmp_path / "w.dat"
    path.write_bytes(b"x" * 100)
    check_files([FileNeed(str(path), 100, "layer.weight")])  # long enough: no error
    with pytest.raises(ValueError, match=re.escape(f"{path} has 100 bytes")) as shrunk:
        check_files([FileNeed(str(path), 101, "layer.weight")])
    assert "'layer.weight' needs its first 101 bytes" in str(shrunk.value)
    gone = tmp_path / "gone.dat"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{gone} no longer exists")) as missing:
        check_files([FileNeed(str(path), 1, "a"), FileNeed(str(gone), 1, "b")])
    assert missing.value.errno == errno.ENOENT and "weight 'b'" in str(missing.value)


# -- spans ----------------------------------------------------------------------------------


def test_spans_are_page_aligned_and_merged_per_file() -> None:
    base = 1000 * PAGE
    assert page_aligned((base + 10, 20, "a")) == Span(base, PAGE, "a")
    assert page_aligned((base + PAGE - 1, 2, "a")) == Span(base, 2 * PAGE, "a")
    assert page_aligned((base, PAGE, "a")) == Span(base, PAGE, "a")
    spans = [
        (base + 5 * PAGE, 1, "a"),  # apart from the others: its own range
        (base + PAGE + 5, 10, "a"),  # touches the first page of "a": merged with it
        (base + 10, 20, "a"),
        (base + 20, 4, "a"),  # inside the first: merged
        (base + 2 * PAGE, 8, "b"),  # next to "a" in memory, but another file
    ]
    assert merge_spans(spans) == (
        Span(base, 2 * PAGE, "a"),
        Span(base + 2 * PAGE, PAGE, "b"),
        Span(base + 5 * PAGE, PAGE, "a"),
    )
    assert merge_spans([]) == ()


# -- paging in ------------------------------------------------------------------------------


@needs_madvise
def test_paging_in_makes_a_map_resident_and_a_resident_range_is_skipped(mapped: Span) -> None:
    PAGER.page_in([mapped], skip_resident=False)
    assert PAGER.resident(mapped.address, mapped.length)
    calls: list[int] = []
    real = PAGER.madvise
    assert real is not None

    def counting(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        return real(address, length, advice)

    pager = Pager(counting, PAGER.mincore)
    pager.page_in([mapped], skip_resident=True)
    assert calls == []  # resident: one mincore, no madvise
    pager.page_in([mapped], skip_resident=False)
    assert calls[0] == MADV_WILLNEED
    assert calls[1:] == ([MADV_POPULATE_READ] if PAGER.populate_works else [])


@needs_madvise
def test_a_file_shrunk_under_its_map_is_named_not_a_sigbus(mapped: Span) -> None:
    if not PAGER.populate_works:
        pytest.skip("this kernel has no MADV_POPULATE_READ")
    os.truncate(mapped.path, PAGE)
    with pytest.raises(ValueError, match=re.escape(f"{mapped.path} is shorter than when")):
        PAGER.page_in([mapped], skip_resident=False)


@pytest.mark.skipif(MADV_WILLNEED is None, reason="no MADV_WILLNEED here")
def test_a_kernel_refusing_populate_gets_read_ahead_only() -> None:
    calls: list[int] = []

    def refusing(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        if advice == 22:
            ctypes.set_errno(errno.EINVAL)  # what a kernel older than 5.14 answers
            return -1
        return 0

    pager = Pager(refusing, None, populate_read=22)
    ranges = [Span(PAGE, PAGE, "a"), Span(3 * PAGE, PAGE, "a")]
    pager.page_in(ranges, skip_resident=True)  # no mincore: nothing counts as resident
    assert calls == [MADV_WILLNEED, 22, MADV_WILLNEED] and not pager.populate_works
    calls.clear()
    pager.page_in(ranges, skip_resident=False)
    assert calls == [MADV_WILLNEED, MADV_WILLNEED]
    assert Pager(refusing, None, populate_read=None).populate_works is False


def test_without_madvise_paging_in_does_nothing() -> None:
    pager = Pager(None, None)
    pager.page_in([Span(PAGE, PAGE, "a")], skip_resident=False)  # no call, no error
    assert not pager.resident(PAGE, PAGE)


@needs_madvise
def test_page_in_background_pages_the_spans_on_a_daemon_thread(mapped: Span) -> None:
    assert page_in_background([]) is None
    thread = page_in_background([(mapped.address + 10, 100, mapped.path)])
    assert thread is not None and thread.daemon and thread.name == "accel-page-in"
    thread.join()
    assert PAGER.resident(mapped.address, PAGE)
