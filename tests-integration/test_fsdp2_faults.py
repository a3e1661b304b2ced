"""FSDP2 checkpoints survive SIGKILL and resume exactly, across launches (2 CPU ranks).

``scripts/fsdp2_resume.py`` trains an FSDP2 model with accumulation, saving every 3
micro-steps (so saves fall inside accumulation windows). The uninterrupted run is the
reference. A run stopped mid-window and resumed in a new launch, and runs whose rank 0 or 1
is SIGKILLed at points inside ``save_state`` (after its DCP model shards, after its optimizer
shards, before the manifest, after the rename), each followed by a resume, must end with
weights bit-identical to the reference, and the checkpoint folder must only ever hold complete
checkpoints (plus at most one hidden ``.incomplete`` one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess

TOTAL = 24
SAVE_EVERY = 3
TIMEOUT = 180.0


def _launch(run_torchrun: Any, project: Path, out: Path, *extra: str) -> tuple[int, str, dict]:
    done = run_torchrun(
        "fsdp2_resume.py",
        "--project-dir",
        str(project),
        "--total-steps",
        str(TOTAL),
        "--save-every",
        str(SAVE_EVERY),
        "--out",
        str(out),
        *extra,
        timeout=TIMEOUT,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, done.stdout + done.stderr, events[-1] if events else {}


def _sound(project: Path) -> list[str]:
    """Problems of the checkpoint folder: every visible checkpoint matches its manifest."""
    problems = []
    base = project / "checkpoints"
    for entry in sorted(base.iterdir()) if base.exists() else []:
        if re.fullmatch(r"\.checkpoint_\d+\.incomplete", entry.name):
            continue
        manifest = entry / "accel_manifest.json"
        if not manifest.exists():
            problems.append(f"{entry.name} has no manifest")
            continue
        listed = {k: v["size"] for k, v in json.loads(manifest.read_text())["files"].items()}
        present = {
            p.relative_to(entry).as_posix(): p.stat().st_size
            for p in entry.rglob("*")
            if p.is_file() and p != manifest
        }
        if listed != present:
            problems.append(f"{entry.name}: manifest {sorted(listed)} but files {sorted(present)}")
    return problems


_REFERENCE: dict[str, Any] = {}


@pytest.fixture
def reference(run_torchrun: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run, launched once for the module."""
    if not _REFERENCE:
        _REFERENCE.update(_uninterrupted(run_torchrun, tmp_path_factory))
    return _REFERENCE


def _uninterrupted(run_torchrun: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fsdp2-reference")
    code, output, end = _launch(run_torchrun, root / "project", root / "w.safetensors")
    assert code == 0, output[-6000:]
    assert end["saves"] == [f"checkpoint_{i}" for i in range(TOTAL // SAVE_EVERY)]
    layout = sorted(
        p.relative_to(root / "project" / "checkpoints" / "checkpoint_7").as_posix()
        for p in (root / "project" / "checkpoints" / "checkpoint_7").rglob("*")
        if p.is_file()
    )
    return {"weights": load_file(root / "w.safetensors"), "layout": layout}


def _same(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    got = load_file(path)
    return sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def test_the_reference_writes_accelerates_fsdp_layout(reference: dict) -> None:
    layout = reference["layout"]
    assert "pytorch_model_fsdp_0/.metadata" in layout and "optimizer_0/.metadata" in layout
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= set(layout)


def test_stopped_mid_window_and_resumed_in_a_new_launch_is_bit_identical(
    run_torchrun: Any, tmp_path: Path, reference: dict
) -> None:
    project, out = tmp_path / "project", tmp_path / "w.safetensors"
    code, output, end = _launch(run_torchrun, project, out, "--stop-at", "10")
    assert code == 0, output[-6000:]
    code, output, end = _launch(run_torchrun, project, out, "--resume")
    assert code == 0, output[-6000:]
    assert (end["loaded"], end["start"]) == ("checkpoint_2", 9)  # saved at 9: mid-window
    assert _same(out, reference["weights"]), output[-3000:]
    assert _sound(project) == []


KILLS = [
    ("dcp-model:6:1", "checkpoint_0"),  # rank 1 after its model shards of the save at 6
    ("dcp-optimizer:9:0", "checkpoint_1"),  # rank 0 after its optimizer shards (mid-window)
    ("manifest:12:0", "checkpoint_2"),  # everything written, no manifest, no rename
    ("commit:15:0", "checkpoint_4"),  # renamed into place: that checkpoint is complete
]


@pytest.mark.parametrize(("kill", "loaded"), KILLS, ids=[k for k, _ in KILLS])
def test_sigkill_inside_save_state_leaves_sound_checkpoints_and_resumes_exactly(
    run_torchrun: Any, tmp_path: Path, reference: dict, kill: str, loaded: str
) -> None:
    project, out = tmp_path / "project", tmp_path / "w.safetensors"
    code, output, _ = _launch(run_torchrun, project, out, "--kill-at", kill)
    assert code != 0, f"{kill}: the run was not killed\n{output[-3000:]}"
    assert _sound(project) == [], output[-3000:]
    code, output, end = _launch(run_torchrun, project, out, "--resume")
    assert code == 0, output[-6000:]
    assert end["loaded"] == loaded, output[-3000:]
    assert _same(out, reference["weights"]), f"{kill}: resumed weights differ"
    assert _sound(project) == []
