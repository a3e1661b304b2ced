"""The GPU staging of the offload engine, driven on the CPU through a fake device.

``FakeApi`` stands for CUDA: its streams queue every copy and cast and run them only when an
event recorded after them is waited for (or the stream is synchronised), as a GPU runs them
later than the host queues them. A staging that refilled a ring slot before the copies out of
it had run would hand back wrong bytes here, and so would a consumer that did not wait for the
unit's event. Page-locking is a table of registered ranges whose answers the tests choose.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel.dispatch import cpu_offload, disk_offload
from accel_bigmodel.hooks import AlignDevicesHook, find_align_devices_hook
from accel_bigmodel.prefetch import PrefetchingMaterializer, copy_threads, host_pinning
from accel_bigmodel.prefetch.copy_api import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
from accel_bigmodel.prefetch.copy_threads import ParallelCopier, Piece, split
from accel_bigmodel.prefetch.cuda_staging import StagedItem, StagingPool, aligned
from accel_bigmodel.prefetch.engine import _host_weights
from accel_bigmodel.prefetch.staging_mode import resolve_copy_threads, resolve_staging_mode
from accel_bigmodel.safetensors_files import SafetensorsFile

PAGE = mmap.PAGESIZE
DEVICE = torch.device("cpu")  # the fake device's tensors live on the CPU
CUDA_ERROR_NOT_SUPPORTED = 801


# -- the fake device ----------------------------------------------------------------------


class FakeStream:
    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.queued: list[Callable[[], None]] = []
        self.ran = 0  # how many queued operations have run

    def run_until(self, position: int) -> None:
        while self.ran < position:
            operation = self.queued[self.ran]
            self.ran += 1
            operation()


class FakeEvent:
    def __init__(self, api: FakeApi, stream: FakeStream) -> None:
        self.stream = stream
        self.position = len(stream.queued)
        self.number = len(api.events)
        api.events.append(self)

    def synchronize(self) -> None:
        self.stream.api.log.append(("sync", self.number))
        self.stream.run_until(self.position)

    def query(self) -> bool:
        return self.stream.ran >= self.position


class FakeApi:
    """A device whose work runs late (see the module documentation)."""

    def __init__(self, register_code: int = 0) -> None:
        self.register_code = register_code
        self.log: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []
        self.current: FakeStream | None = None
        self.pinned_buffers: list[torch.Tensor] = []
        self.registered: dict[int, int] = {}  # start -> length
        self.register_calls: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.streams: list[FakeStream] = []

    # streams and work
    def new_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(self)
        self.streams.append(stream)
        return stream

    def on_stream(self, device: torch.device, stream: FakeStream) -> Any:
        api = self

        class _On:
            def __enter__(self) -> None:
                api.current = stream

            def __exit__(self, *exc: object) -> None:
                api.current = None

        return _On()

    def _queue(self, operation: Callable[[], None]) -> None:
        assert self.current is not None, "device work queued outside the side stream"
        self.current.queued.append(operation)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_buffers.append(buffer)
        self.log.append(("pin", buffer.data_ptr()))
        return buffer

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        assert target.numel() == source.numel()
        slot = self._slot_of(source)
        self.log.append(("copy", slot, self.is_pinned(source)))
        self._queue(lambda: target.copy_(source))

    def cast(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        result = torch.empty(source.shape, dtype=dtype)
        self._queue(lambda: result.copy_(source.to(dtype)))
        return result

    def record(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(self, stream)
        self.log.append(("record", event.number, len(stream.queued)))
        return event

    def hand_over(
        self, device: torch.device, event: FakeEvent, tensors: list[torch.Tensor]
    ) -> None:
        self.log.append(("hand_over", event.number))
        event.stream.run_until(event.position)  # the consumer's stream waits for the event

    def synchronize(self, stream: FakeStream) -> None:
        self.log.append(("synchronize",))
        stream.run_until(len(stream.queued))

    # page-locking
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for buffer in self.pinned_buffers:
            if buffer.data_ptr() <= start and end <= buffer.data_ptr() + buffer.numel():
                return True
        return any(s <= start and end <= s + n for s, n in self.registered.items())

    def register(self, address: int, nbytes: int, device: torch.device) -> int:
        assert address % PAGE == 0 and nbytes % PAGE == 0, "ranges are whole pages"
        for start, length in self.registered.items():
            assert not (start < address + nbytes and address < start + length), "overlap"
        self.register_calls.append((address, nbytes))
        if self.register_code == 0:
            self.registered[address] = nbytes
        return self.register_code

    def unregister(self, address: int) -> int:
        assert self.streams and all(s.ran == len(s.queued) for s in self.streams), (
            "unregistered while copies were still queued"
        )
        self.unregistered.append(address)
        self.registered.pop(address, None)
        return 0

    def error_name(self, code: int) -> str:
        return f"CUDA_ERROR_{code}"

    def _slot_of(self, source: torch.Tensor) -> int | None:
        for number, buffer in enumerate(self.pinned_buffers):
            if buffer.data_ptr() <= source.data_ptr() < buffer.data_ptr() + buffer.numel():
                return number
        return None


class LoggingCopier(ParallelCopier):
    """The real copier, logging which ring slot each fill writes."""

    def __init__(self, api: FakeApi, threads: int) -> None:
        super().__init__(threads)
        self.api = api

    def copy(self, pieces: Any) -> None:
        slots: set[int] = set()
        for piece in pieces:
            for number, buffer in enumerate(self.api.pinned_buffers):
                if buffer.data_ptr() <= piece.target < buffer.data_ptr() + buffer.numel():
                    slots.add(number)
        self.api.log.append(("fill", tuple(sorted(slots))))
        super().copy(pieces)


# -- units to stage ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_foreign_registrations() -> Iterator[None]:
    yield
    assert not host_pinning._TAKEN, "a test left page-locked ranges registered"


class _Owner(nn.Module):
    pass


HOOK = AlignDevicesHook(execution_device="cpu")


def _items(
    tensors: dict[str, torch.Tensor], resident: bool = True, dtype: torch.dtype | None = None
) -> list[StagedItem]:
    return [
        StagedItem(HOOK, name, tensor, dtype or tensor.dtype, resident)
        for name, tensor in tensors.items()
    ]


def _weights(
    seed: int, sizes: tuple[int, ...] = (3000, 17, 9000, 1, 4096)
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(size, generator=generator) for i, size in enumerate(sizes)}


def _on_pages_of_their_own(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` that share no memory page with any other tensor.

    A registration covers whole pages, so a disk weight that the allocator put on a page of a
    resident weight is page-locked too, and rightly copied straight; tests that count the
    bytes of each path keep their disk weights apart.
    """
    apart = {}
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        backing = torch.empty(nbytes + 3 * PAGE, dtype=torch.uint8)
        start = (-backing.data_ptr()) % PAGE + PAGE  # a page in from either end
        view = backing[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        apart[name] = view.copy_(tensor)
    return apart


def _pool(
    api: FakeApi, mode: str = "auto", slot_bytes: int | None = None, threads: int = 2
) -> StagingPool:
    pool = StagingPool(api, mode, threads, largest=1 << 20)  # type: ignore[arg-type]
    pool.copier = LoggingCopier(api, threads)
    if slot_bytes is not None:
        pool.slot_bytes = slot_bytes
    return pool


def _stage(pool: StagingPool, items: list[StagedItem]) -> dict[str, torch.Tensor]:
    staged = pool.stage({DEVICE: items})
    values = staged.take(HOOK)
    assert values is not None
    return values


# -- the ring ---------------------------------------------------------------------------------


def test_ring_slots_are_refilled_only_after_their_copies_ran() -> None:
    api = FakeApi()
    pool = _pool(api, mode="ring", slot_bytes=4096)  # 4 slots of 4 KiB for ~64 KB of weights
    weights = _weights(0)
    try:
        values = _stage(pool, _items(weights))
        for name, tensor in weights.items():
            assert torch.equal(values[name], tensor), name  # late copies read the right bytes
        fills = [entry for entry in api.log if entry[0] == "fill"]
        assert len(fills) > 4, "the unit went round the ring more than once"
        # Before a slot is filled again, the event recorded behind its copies was waited for.
        last_event: dict[int, int] = {}
        copied: set[int] = set()
        waited: set[int] = set()
        refills = 0
        for entry in api.log:
            if entry[0] == "copy" and entry[1] is not None:
                copied.add(entry[1])
            elif entry[0] == "record":
                last_event.update(dict.fromkeys(copied, entry[1]))
                copied.clear()
            elif entry[0] == "sync":
                waited.add(entry[1])
            elif entry[0] == "fill":
                for slot in entry[1]:
                    if slot in last_event:
                        refills += 1
                        assert last_event[slot] in waited, f"slot {slot} refilled too early"
        assert refills > 0
        assert pool.report()["ring_bytes"] == sum(t.numel() * 4 for t in weights.values())
        assert pool.report()["direct_bytes"] == 0 and api.register_calls == []
    finally:
        pool.close()


def test_the_consumer_waits_for_the_units_event() -> None:
    api = FakeApi()
    pool = _pool(api, mode="ring", slot_bytes=1 << 16)
    weights = _weights(1, (50, 60))
    try:
        staged = pool.stage({DEVICE: _items(weights)})
        raw = staged.values[HOOK]["w0"]
        assert not torch.equal(raw, weights["w0"])  # queued, not run: the device is late
        values = staged.take(HOOK)
        assert values is not None and torch.equal(values["w0"], weights["w0"])
        handed = [entry for entry in api.log if entry[0] == "hand_over"]
        records = [entry for entry in api.log if entry[0] == "record"]
        assert handed == [("hand_over", records[-1][1])]  # the unit's last event
        assert records[-1][2] == len(api.streams[0].queued)  # recorded after all its work
    finally:
        pool.close()


def test_weights_are_cast_on_the_device_after_their_copy() -> None:
    api = FakeApi()
    pool = _pool(api, mode="ring")
    weights = {"half": torch.randn(33, 7).to(torch.bfloat16), "ints": torch.arange(5)}
    items = [
        StagedItem(HOOK, "half", weights["half"], torch.float32, False),
        StagedItem(HOOK, "ints", weights["ints"], torch.int64, False),
    ]
    try:
        values = _stage(pool, items)
        assert values["half"].dtype == torch.float32 and values["half"].shape == (33, 7)
        assert torch.equal(values["half"], weights["half"].float())
        assert torch.equal(values["ints"], weights["ints"])
    finally:
        pool.close()


# -- page-locking in place ------------------------------------------------------------------


def test_resident_weights_are_page_locked_once_and_copied_straight() -> None:
    api = FakeApi()
    pool = _pool(api)
    resident, on_disk = _weights(2), _on_pages_of_their_own(_weights(3, (500, 20)))
    items = _items(resident) + _items(on_disk, resident=False)
    try:
        for _ in range(3):
            values = _stage(pool, items)
            for name, tensor in {**resident, **on_disk}.items():
                assert torch.equal(values[name], tensor)
        report = pool.report()
        resident_bytes = sum(t.numel() * 4 for t in resident.values())
        assert report["direct_bytes"] == 3 * resident_bytes
        assert report["ring_bytes"] == 3 * sum(t.numel() * 4 for t in on_disk.values())
        assert report["registered_bytes"] >= resident_bytes and not report["registration_refused"]
        calls = len(api.register_calls)
        assert 1 <= calls <= len(resident)  # once, neighbouring tensors merged
        direct = [entry for entry in api.log if entry[0] == "copy" and entry[1] is None]
        assert all(entry[2] for entry in direct)  # every straight copy read page-locked memory
    finally:
        pool.close()
    assert sorted(api.unregistered) == sorted(start for start, _ in api.register_calls)
    assert api.registered == {}


@pytest.mark.parametrize("mode, level", [("auto", logging.INFO), ("register", logging.WARNING)])
def test_a_refusal_falls_back_to_the_ring_and_is_not_retried(
    mode: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApi(register_code=CUDA_ERROR_NOT_SUPPORTED)
    pool = _pool(api, mode=mode)
    weights = _weights(4)
    try:
        with caplog.at_level(logging.DEBUG, logger="accel_bigmodel.prefetch.host_pinning"):
            for _ in range(2):
                values = _stage(pool, _items(weights))
                assert all(torch.equal(values[n], t) for n, t in weights.items())
        assert len(api.register_calls) == 1
        report = pool.report()
        assert report["direct_bytes"] == 0 and report["registration_refused"]
        records = [r for r in caplog.records if "page-locking" in r.getMessage()]
        assert [r.levelno for r in records] == [level]
        assert "CUDA_ERROR_801" in records[0].getMessage()
        assert "ACCEL_OFFLOAD_STAGING=ring" in records[0].getMessage()
    finally:
        pool.close()


def test_ring_mode_never_page_locks_and_memory_pinned_elsewhere_is_used_as_is() -> None:
    api = FakeApi()
    pool = _pool(api, mode="ring")
    weights = _weights(5, (100,))
    already = api.pinned(4096)  # e.g. a pin_memory() tensor
    already.view(torch.float32)[:100].copy_(weights["w0"])
    items = _items(weights) + [
        StagedItem(HOOK, "pinned", already.view(torch.float32)[:100], torch.float32, True)
    ]
    try:
        values = _stage(pool, items)
        assert torch.equal(values["pinned"], weights["w0"]) and torch.equal(
            values["w0"], weights["w0"]
        )
        assert api.register_calls == []
        assert pool.report()["direct_bytes"] == 400 and pool.report()["ring_bytes"] == 400
    finally:
        pool.close()


def test_already_registered_memory_takes_the_ring_without_disabling_registration() -> None:
    api = FakeApi(register_code=CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    pool = _pool(api)
    weights = _weights(6, (5000,))
    try:
        values = _stage(pool, _items(weights))
        assert torch.equal(values["w0"], weights["w0"])
        assert pool.pinning.works and pool.report()["ring_bytes"] == 20000
    finally:
        pool.close()


def test_another_engines_pages_and_strided_weights_are_not_page_locked() -> None:
    first_api, second_api = FakeApi(), FakeApi()
    first, second = _pool(first_api), _pool(second_api)
    shared = torch.randn(4 * PAGE)
    strided = torch.randn(64, 64).t()
    try:
        _stage(first, _items({"a": shared[: PAGE // 2]}))
        assert first_api.register_calls
        values = _stage(second, _items({"b": shared[PAGE // 4 : PAGE], "s": strided}))
        assert torch.equal(values["b"], shared[PAGE // 4 : PAGE])
        assert torch.equal(values["s"], strided)
        assert second_api.register_calls == []  # touches the first engine's page; not contiguous
        assert second.report()["direct_bytes"] == 0
    finally:
        first.close()
        second.close()


def test_a_weight_viewing_a_file_map_is_page_locked_in_place(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(3 * PAGE)}, str(path), {"format": "pt"})
    handle = SafetensorsFile(str(path))
    view = handle.view("w")
    api = FakeApi()
    pool = _pool(api)
    try:
        values = _stage(pool, _items({"w": view}))
        assert torch.equal(values["w"], view)
        start = view.data_ptr() - view.data_ptr() % PAGE
        assert api.register_calls[0][0] == start  # the map's own pages: no copy of the file
    finally:
        pool.close()
        handle.close()


# -- what the engine stages -----------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def _offload_hooks(model: nn.Module) -> list[AlignDevicesHook]:
    hooks = [find_align_devices_hook(module) for module in model.modules()]
    return [hook for hook in hooks if hook is not None and hook.offload]


def test_cpu_offloaded_weights_are_resident_and_disk_ones_are_not(tmp_path: Path) -> None:
    in_ram = cpu_offload(_model(), prefetch_depth=0)
    on_disk = disk_offload(_model(), tmp_path / "offload", prefetch_depth=0)
    for model, resident in ((in_ram, True), (on_disk, False)):
        for hook in _offload_hooks(model):
            items = _host_weights(hook, {})
            assert items and {item.resident for item in items} == {resident}
            assert all(item.dtype == item.host.dtype for item in items)
    hook = _offload_hooks(in_ram)[0]
    wanted = {name: torch.bfloat16 for name in hook.offloaded_names}
    assert {item.dtype for item in _host_weights(hook, wanted)} == {torch.bfloat16}


def test_the_staging_settings_come_from_the_arguments_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ACCEL_OFFLOAD_STAGING", raising=False)
    monkeypatch.delenv("ACCEL_OFFLOAD_COPY_THREADS", raising=False)
    assert resolve_staging_mode() == "auto" and 1 <= resolve_copy_threads() <= 4
    monkeypatch.setenv("ACCEL_OFFLOAD_STAGING", " Ring ")
    monkeypatch.setenv("ACCEL_OFFLOAD_COPY_THREADS", "3")
    engine = PrefetchingMaterializer(1)
    assert (engine.staging, engine.copy_threads) == ("ring", 3)
    assert PrefetchingMaterializer(1, staging="register", copy_threads=1).staging == "register"
    monkeypatch.setenv("ACCEL_OFFLOAD_STAGING", "pinned")
    with pytest.raises(ValueError, match=r"ACCEL_OFFLOAD_STAGING='pinned'.*auto, register, ring"):
        PrefetchingMaterializer(1)
    with pytest.raises(ValueError, match=r"staging='fast'"):
        PrefetchingMaterializer(1, staging="fast")  # type: ignore[arg-type]
    monkeypatch.setenv("ACCEL_OFFLOAD_STAGING", "auto")
    monkeypatch.setenv("ACCEL_OFFLOAD_COPY_THREADS", "0")
    with pytest.raises(ValueError, match="ACCEL_OFFLOAD_COPY_THREADS='0'"):
        PrefetchingMaterializer(1)
    with pytest.raises(ValueError, match="copy_threads=True"):
        PrefetchingMaterializer(1, copy_threads=True)


# -- the copy threads ---------------------------------------------------------------------


def test_split_covers_every_byte_once_in_at_most_the_parts_asked() -> None:
    pieces = [Piece(1000, 5000, 3 << 20), Piece(90_000_000, 70_000_000, 100), Piece(7, 9, 0)]
    for parts in (1, 2, 3, 8):
        groups = split(pieces, parts)
        assert 1 <= len(groups) <= parts
        flat = [piece for group in groups for piece in group]
        assert sum(p.length for p in flat) == (3 << 20) + 100
        covered = sorted((p.target, p.target + p.length) for p in flat)
        for (_, end), (start, _) in zip(covered, covered[1:], strict=False):
            assert end <= start
        assert all(p.source - p.target == 4000 for p in flat if p.target < 90_000_000)
    assert len(split(pieces, 8)) == 4  # nothing under 1 MiB is handed out
    assert split([], 4) == []


def test_the_copier_copies_with_several_named_threads_and_stops_them() -> None:
    source = torch.randint(0, 255, (9 << 20,), dtype=torch.uint8)
    target = torch.zeros_like(source)
    copier = ParallelCopier(3)
    before = set(threading.enumerate())
    copier.copy([Piece(target.data_ptr(), source.data_ptr(), source.numel())])
    started = set(threading.enumerate()) - before
    assert torch.equal(target, source)
    assert {thread.name for thread in started} == {copy_threads.THREAD_NAME} and len(started) == 2
    copier.close()
    assert not any(thread.is_alive() for thread in started)
    assert aligned(1) == 256 and aligned(256) == 256
