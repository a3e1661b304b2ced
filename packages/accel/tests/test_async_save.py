"""``save_state(async_save=True)``: captured at the call, written in the background, same files.

What the call captures is what the checkpoint holds, whatever training does next; the files are
byte-identical to a synchronous save of the same state; one save is in flight at most; a
failed write is raised by the next call and commits nothing; buffers are reused; nothing is
left running after ``end_training`` or at interpreter exit. Two processes killed during a
background write: ``tests-integration/test_auto_resume_launch.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel.checkpoint_writing
from accel.accelerator import Accelerator
from accel.async_save import WRITER_THREAD_NAME, HostSnapshot
from accel.checkpointing import CheckpointError
from accel.handlers import ProjectConfiguration
from accel_state.testing import run_on_cpu


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


def _prepared(accelerator: Accelerator, counter: _Counter | None = None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    if counter is not None:
        accelerator.register_for_checkpointing(counter)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _train(accelerator: Accelerator, objects: tuple[Any, ...], steps: int) -> None:
    model, optimizer, loader, scheduler = objects
    done = 0
    while done < steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def _bytes(directory: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD_NAME]


class _Gate:
    """Holds the writer thread inside its first file write until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = accel.checkpoint_writing._torch_save

        def gated(obj: Any, path: Path) -> None:
            if threading.current_thread().name == WRITER_THREAD_NAME:
                self.entered.set()
                assert self.release.wait(30)
                if fail:
                    raise OSError(28, "injected: no space left on device")
            real(obj, path)

        monkeypatch.setattr(accel.checkpoint_writing, "_torch_save", gated)


@pytest.mark.parametrize("safe", [True, False])
def test_the_checkpoint_is_the_state_at_the_call_and_byte_identical_to_a_sync_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, safe: bool
) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    counter = _Counter()
    objects = _prepared(accelerator, counter)
    _train(accelerator, objects, 5)  # mid-accumulation: partial gradients are saved too
    counter.n = 5
    gate = _Gate(monkeypatch)
    accelerator.save_state(tmp_path / "sync", safe_serialization=safe, async_save=False)
    returned = accelerator.save_state(tmp_path / "async", safe_serialization=safe, async_save=True)
    assert gate.entered.wait(30)
    assert not Path(returned).exists()  # still being written
    # Training goes on while the writer is held: none of it may reach the checkpoint.
    _train(accelerator, objects, 3)
    counter.n = 8
    gate.release.set()
    accelerator.wait_for_checkpoint()
    sync, background = _bytes(tmp_path / "sync"), _bytes(returned)
    assert "accel_gradients_0.safetensors" in sync
    assert sync.keys() == background.keys()
    for name in sync:
        assert sync[name] == background[name], name
    assert not list(tmp_path.glob(".*incomplete"))
    accelerator.end_training()


def test_the_next_save_waits_and_total_limit_prunes_only_complete_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2, async_save=True
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    objects = _prepared(accelerator)
    base = tmp_path / "checkpoints"
    for _ in range(2):
        _train(accelerator, objects, 1)
        accelerator.save_state()
    accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in base.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    gate = _Gate(monkeypatch)
    accelerator.save_state()  # checkpoint_2, held in flight
    assert gate.entered.wait(30)
    # Nothing is pruned before the new checkpoint is complete.
    assert sorted(p.name for p in base.iterdir()) == [
        ".checkpoint_2.incomplete",
        "checkpoint_0",
        "checkpoint_1",
    ]
    timer = threading.Timer(0.3, gate.release.set)
    timer.start()
    accelerator.save_state()  # waits for checkpoint_2, then writes checkpoint_3
    assert (base / "checkpoint_2" / "accel_manifest.json").exists()
    accelerator.end_training()  # waits for checkpoint_3
    timer.join()
    assert sorted(p.name for p in base.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    assert not _writer_threads()


def test_a_failed_background_write_is_raised_by_the_next_call_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, optimizer, loader, scheduler = objects = _prepared(accelerator)
    accelerator.save_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate = _Gate(monkeypatch, fail=True)
    accelerator.save_state(async_save=True)
    assert gate.entered.wait(30)
    gate.release.set()
    for thread in _writer_threads():
        thread.join(30)
    xb, yb = next(iter(loader))
    with pytest.raises(OSError, match="no space left"):
        accelerator.backward(F.mse_loss(model(xb), yb))
    optimizer.zero_grad()
    accelerator.wait_for_checkpoint()  # raised once, not twice
    base = tmp_path / "checkpoints"
    assert sorted(p.name for p in base.iterdir()) == [".checkpoint_1.incomplete", "checkpoint_0"]
    monkeypatch.undo()
    _train(accelerator, objects, 2)
    assert accelerator.load_state().endswith("checkpoint_0")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    accelerator.save_state(async_save=True)  # the next save cleans the leftover up
    accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in base.iterdir()) == ["checkpoint_0", "checkpoint_2"]
    accelerator.end_training()


def test_end_training_raises_a_pending_failure_after_finishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    gate = _Gate(monkeypatch, fail=True)
    accelerator.save_state(tmp_path / "ckpt", async_save=True)
    gate.release.set()
    with pytest.raises(OSError, match="injected"):
        accelerator.end_training()
    assert not _writer_threads()
    assert not (tmp_path / "ckpt").exists()


def test_the_host_snapshot_reuses_its_buffers_and_keeps_shared_storage() -> None:
    snapshot = HostSnapshot()
    weight = torch.randn(8, 4)
    flat = torch.arange(10.0)
    state = {
        "model": {"a": weight, "tied": weight, "t": weight.t()},
        "pieces": [flat[:4], flat[4:].view(2, 3)],  # views into one storage, as gathers give
        "other": torch.ones(3),
        "meta": {"lr": [0.1]},
    }
    first = snapshot.capture(state)
    held = snapshot.nbytes
    copy_a, copy_t = first["model"]["a"], first["model"]["t"]
    assert copy_a is first["model"]["tied"]
    assert copy_t.stride() == weight.t().stride() and torch.equal(copy_t, weight.t())
    assert copy_t.untyped_storage().data_ptr() == copy_a.untyped_storage().data_ptr()
    low, high = first["pieces"]
    assert high.storage_offset() == 4 and torch.equal(high, flat[4:].view(2, 3))
    assert low.untyped_storage().data_ptr() == high.untyped_storage().data_ptr()
    assert copy_a.data_ptr() != weight.data_ptr()
    weight.add_(1.0)
    state["meta"]["lr"][0] = 0.2
    assert not torch.equal(copy_a, weight)
    assert first["meta"]["lr"] == [0.1]
    second = snapshot.capture(state)
    assert second["model"]["a"].data_ptr() == copy_a.data_ptr()  # the same buffer, reused
    assert torch.equal(second["model"]["a"], weight)
    # One buffer per storage: the weight's, the flat one's, the other's.
    assert snapshot.nbytes == held == (32 + 10 + 3) * 4
    snapshot.capture({"model": {"a": torch.zeros(3)}})
    assert snapshot.nbytes == 3 * 4  # buffers of vanished or resized entries are let go


def test_bad_switches_are_refused_naming_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"async_save='yes'"):
        ProjectConfiguration(project_dir=str(tmp_path), async_save="yes")  # type: ignore[arg-type]
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)
    with pytest.raises(TypeError, match=r"save_state\(async_save=1\)"):
        accelerator.save_state(tmp_path / "x", async_save=1)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()
    accelerator.end_training()


def test_interpreter_exit_waits_for_the_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time, torch
        import accel.checkpoint_writing as writing
        from accel import Accelerator
        real = writing._torch_save
        def slow(obj, path):
            time.sleep(0.5)
            real(obj, path)
        writing._torch_save = slow
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(3, 3))
        accelerator.save_state({str(tmp_path / "ckpt")!r}, async_save=True)
        print("returned", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "returned" in done.stdout
    assert (tmp_path / "ckpt" / "accel_manifest.json").exists()


def test_engines_with_their_own_layout_refuse_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True)
    _prepared(accelerator)

    class _Layout:
        writes_in_background = False

    monkeypatch.setattr(accelerator.engine, "checkpoint_layout", lambda: _Layout())
    with pytest.raises(ValueError, match=r"async_save=True.*own layout.*async_save=False"):
        accelerator.save_state(tmp_path / "ckpt", async_save=True)
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    accelerator.end_training()


# --- two processes -----------------------------------------------------------------------


def _same_file(first: Path, second: Path) -> bool:
    """Equal bytes; for DCP's ``.metadata``, equal content but for ``storage_meta`` (the
    folder and random ids of each save, different between two synchronous saves too); for the
    manifest, the same files and sizes but for those ``.metadata`` files."""
    if first.name == ".metadata":
        from torch.distributed.checkpoint import FileSystemReader

        one, two = (FileSystemReader(str(p.parent)).read_metadata() for p in (first, second))
        one.storage_meta = two.storage_meta = None
        return bool(one == two)
    if first.name == "accel_manifest.json":
        one, two = (json.loads(p.read_text()) for p in (first, second))
        for manifest in (one, two):
            for name in [n for n in manifest["files"] if n.endswith("/.metadata")]:
                manifest["files"][name] = "DCP metadata"
        return bool(one == two)
    return first.read_bytes() == second.read_bytes()


def _two_process_worker(folder: str, engine: str) -> dict[str, Any]:
    from accel.utils import FullyShardedDataParallelPlugin

    root = Path(folder)
    rank_folder = root / engine
    options: dict[str, Any] = {}
    if engine.startswith("fsdp2"):
        kind = "FULL_STATE_DICT" if engine.endswith("full") else "SHARDED_STATE_DICT"
        options["fsdp_plugin"] = FullyShardedDataParallelPlugin(state_dict_type=kind)
    accelerator = Accelerator(gradient_accumulation_steps=2, **options)
    objects = _prepared(accelerator)
    _train(accelerator, objects, 3)  # inside a window
    accelerator.save_state(rank_folder / "sync")
    background = accelerator.save_state(rank_folder / "async", async_save=True)
    _train(accelerator, objects, 3)  # changes everything while the files are written
    accelerator.wait_for_checkpoint()
    files = {
        str(p.relative_to(rank_folder / "sync")): p.read_bytes()
        for p in sorted((rank_folder / "sync").rglob("*"))
        if p.is_file()
    }
    differing = [
        name
        for name in files
        if not _same_file(rank_folder / "sync" / name, Path(background) / name)
    ]
    count = len([p for p in Path(background).rglob("*") if p.is_file()])

    # A write failing on one process only: the other learns it, nothing is committed.
    real = accel.checkpoint_writing._torch_save

    def failing(obj: Any, path: Path) -> None:
        if accelerator.process_index == 1:
            raise OSError(28, "injected on process 1")
        real(obj, path)

    accel.checkpoint_writing._torch_save = failing
    accelerator.save_state(rank_folder / "failed", async_save=True)
    try:
        accelerator.wait_for_checkpoint()
        raised = ""
    except (OSError, CheckpointError) as error:
        raised = f"{type(error).__name__}: {error}"
    accel.checkpoint_writing._torch_save = real
    accelerator.wait_for_everyone()
    committed = (rank_folder / "failed").exists()
    accelerator.end_training()
    return {
        "files": sorted(files),
        "differing": differing,
        "count": count,
        "raised": raised,
        "committed": committed,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        pytest.param("fsdp2-sharded", marks=pytest.mark.torch_feature("fully_shard")),
        pytest.param("fsdp2-full", marks=pytest.mark.torch_feature("fully_shard")),
    ],
)
def test_two_processes_write_what_a_sync_save_writes_and_agree_on_failures(
    tmp_path: Path, engine: str
) -> None:
    results = run_on_cpu(_two_process_worker, str(tmp_path), engine, timeout=180)
    for result in results:
        assert result["differing"] == [], (engine, result["differing"])
        assert result["count"] == len(result["files"])
        assert not result["committed"]
    assert results[0]["files"] and "accel_manifest.json" in results[0]["files"]
    if engine == "fsdp2-sharded":
        assert any(name.endswith(".distcp") for name in results[0]["files"])
    assert results[1]["raised"].startswith("OSError") and "injected" in results[1]["raised"]
    assert results[0]["raised"].startswith("CheckpointError")
    assert "another process failed" in results[0]["raised"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_capture_does_not_wait_and_the_checkpoint_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinned buffers and a side stream: the call returns before the copies finish, training
    # that changes the weights next waits for them on the GPU, and what is written is the
    # state at the call. torch.save records the tensors of the .bin files as CPU tensors
    # (a synchronous save records cuda:0); safetensors files are byte-identical.
    accelerator = Accelerator(gradient_accumulation_steps=2)
    objects = _prepared(accelerator)
    _train(accelerator, objects, 5)
    model = objects[0]
    gate = _Gate(monkeypatch)
    accelerator.save_state(tmp_path / "sync")
    at_call = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    accelerator.save_state(tmp_path / "async", async_save=True)
    assert accelerator._background_saves.snapshot.nbytes > 0
    assert all(b.is_pinned() for b in accelerator._background_saves.snapshot._buffers.values())
    _train(accelerator, objects, 3)
    gate.release.set()
    accelerator.wait_for_checkpoint()
    sync, background = _bytes(tmp_path / "sync"), _bytes(tmp_path / "async")
    assert sync["model.safetensors"] == background["model.safetensors"]
    accelerator.load_state(tmp_path / "async")
    for name, value in model.state_dict().items():
        assert value.is_cuda and torch.equal(value.cpu(), at_call[name]), name
    accelerator.end_training()
