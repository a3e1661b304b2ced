"""DeepSpeed checkpoints survive SIGKILL and resume exactly, across launches (2 CPU ranks).

``scripts/fsdp2_resume.py --engine zero2|zero3`` trains under DeepSpeed with accumulation,
saving every 4 micro-steps (at the end of a window) or every 3 (inside windows too: DeepSpeed's
partial gradients are saved and put back). The uninterrupted run is the reference; a run stopped
and resumed in a new launch (at a window's end, and inside a window),
and runs whose rank 0 or 1 is SIGKILLed inside ``save_state`` (after DeepSpeed wrote its
files, before the manifest, after the rename), each followed by a resume, must end with
weights bit-identical to it, and the checkpoint folder must only hold complete checkpoints.
Runs where deepspeed is installed (the ``deepspeed`` nox session).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.multiprocess

TOTAL = 24
SAVE_EVERY = 4
TIMEOUT = 180.0
_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def _launch(
    run_torchrun: Any, engine: str, project: Path, out: Path, *extra: str, every: int = SAVE_EVERY
) -> Any:
    done = run_torchrun(
        "fsdp2_resume.py",
        "--engine", engine, "--project-dir", str(project), "--total-steps", str(TOTAL),
        "--save-every", str(every), "--out", str(out), *extra,
        timeout=TIMEOUT,
    )  # fmt: skip
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, done.stdout + done.stderr, events[-1] if events else {}


def _sound(project: Path) -> list[str]:
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
            problems.append(f"{entry.name}: manifest and files differ")
    return problems


def _reference(run_torchrun: Any, engine: str, tmp: pytest.TempPathFactory) -> dict:
    if engine not in _REFERENCES:
        root = tmp.mktemp(f"{engine}-reference")
        code, output, end = _launch(run_torchrun, engine, root / "project", root / "w.st")
        assert code == 0, output[-6000:]
        assert end["saves"] == [f"checkpoint_{i}" for i in range(TOTAL // SAVE_EVERY)]
        _REFERENCES[engine] = load_file(root / "w.st")
    return _REFERENCES[engine]


def _same(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    got = load_file(path)
    return sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in got)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_stopped_and_resumed_in_a_new_launch_is_bit_identical(
    run_torchrun: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, engine: str
) -> None:
    expected = _reference(run_torchrun, engine, tmp_path_factory)
    project, out = tmp_path / "project", tmp_path / "w.st"
    code, output, _ = _launch(run_torchrun, engine, project, out, "--stop-at", "10")
    assert code == 0, output[-6000:]
    code, output, end = _launch(run_torchrun, engine, project, out, "--resume")
    assert code == 0, output[-6000:]
    assert (end["loaded"], end["start"]) == ("checkpoint_1", 8)
    assert _same(out, expected)
    assert _sound(project) == []


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_stopped_inside_a_window_and_resumed_in_a_new_launch_is_bit_identical(
    run_torchrun: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, engine: str
) -> None:
    expected = _reference(run_torchrun, engine, tmp_path_factory)
    project, out = tmp_path / "project", tmp_path / "w.st"
    code, output, _ = _launch(run_torchrun, engine, project, out, "--stop-at", "10", every=3)
    assert code == 0, output[-6000:]
    newest = project / "checkpoints" / "checkpoint_2"  # micro-step 9: the window is half done
    assert sorted(p.name for p in newest.glob("accel_gradients_*")) == [
        "accel_gradients_0.safetensors",
        "accel_gradients_1.safetensors",
    ]
    code, output, end = _launch(run_torchrun, engine, project, out, "--resume", every=3)
    assert code == 0, output[-6000:]
    assert (end["loaded"], end["start"]) == ("checkpoint_2", 9)
    assert _same(out, expected)
    assert _sound(project) == []


KILLS = [
    ("ds-save:8:1", "checkpoint_0"),  # rank 1 right after DeepSpeed wrote its files
    ("manifest:12:0", "checkpoint_1"),  # everything written, no manifest, no rename
    ("commit:16:0", "checkpoint_3"),  # renamed into place: that checkpoint is complete
]


@pytest.mark.parametrize(("kill", "loaded"), KILLS, ids=[k for k, _ in KILLS])
def test_sigkill_inside_save_state_under_zero2_resumes_exactly(
    run_torchrun: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    kill: str,
    loaded: str,
) -> None:
    expected = _reference(run_torchrun, "zero2", tmp_path_factory)
    project, out = tmp_path / "project", tmp_path / "w.st"
    code, output, _ = _launch(run_torchrun, "zero2", project, out, "--kill-at", kill)
    assert code != 0, f"{kill}: the run was not killed\n{output[-3000:]}"
    assert _sound(project) == [], output[-3000:]
    code, output, end = _launch(run_torchrun, "zero2", project, out, "--resume")
    assert code == 0, output[-6000:]
    assert end["loaded"] == loaded, output[-3000:]
    assert _same(out, expected), f"{kill}: resumed weights differ"
    assert _sound(project) == []
