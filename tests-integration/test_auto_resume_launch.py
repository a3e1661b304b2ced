"""Runs that resume themselves: ``accel launch --max_restarts 3`` + ``accelerator.resume()``.

``scripts/auto_resume_run.py`` on 2 gloo CPU processes is SIGKILLed three times at micro-steps
drawn by ``random.Random(SEED)``, by either rank; torchrun's agent restarts both processes,
each attempt calls ``resume()`` and continues from the newest complete checkpoint. The run
must end with weights bit-identical to the same command run without kills, and each attempt
must resume from the newest checkpoint taken before the kill (at most one interval of
micro-steps redone), or, when a background write was still in flight at the kill, from the
one before it (that checkpoint was not complete: at most two intervals). DDP and
FSDP2 (its sharded layout: DCP on the writer threads) with asynchronous saves, one kill inside
a background write, after training went on. (Synchronous FSDP2 saves under kills:
test_fsdp2_faults.py.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parent / "scripts" / "auto_resume_run.py"
SEED = 31
TOTAL = 36  # micro-steps: 3 epochs of 12 batches per rank
SAVE_EVERY = 4
TIMEOUT = 300
LOST: list[int] = []  # micro-steps redone after each kill (printed with -s)
pytestmark = pytest.mark.multiprocess

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _launch(project: Path, engine: str, async_save: bool, kills: list[str]) -> tuple[str, Path]:
    out = project / "final.safetensors"
    command = [
        sys.executable,
        "-m",
        "accel_launch",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--max_restarts",
        "3",
        "-q",
        str(SCRIPT),
        "--project-dir",
        str(project),
        "--total",
        str(TOTAL),
        "--save-every",
        str(SAVE_EVERY),
        "--engine",
        engine,
        "--out",
        str(out),
        *(["--async-save"] if async_save else []),
        *[part for kill in kills for part in ("--kill", kill)],
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT, env=ENV, cwd=project
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    return output, out


def _kills(async_save: bool) -> list[tuple[int, int, str]]:
    """Three (rank, micro-step, where), in order, at least two intervals apart."""
    draw = random.Random(SEED)
    steps = sorted(draw.sample(range(3, TOTAL - 2, 7), 3))
    points = [(draw.randrange(2), step, "step") for step in steps]
    if async_save:  # the middle kill lands in the background write of a save
        rank, step, _ = points[1]
        points[1] = (rank, step - step % SAVE_EVERY or SAVE_EVERY, "write")
    return points


def _events(output: str, tag: str) -> list[dict[str, object]]:
    return [
        json.loads(line.split(f"{tag} ", 1)[1])
        for line in output.splitlines()
        if f"{tag} {{" in line
    ]


@pytest.mark.parametrize(("engine", "async_save"), [("ddp", True), ("fsdp2", True)])
def test_a_run_killed_three_times_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, engine: str, async_save: bool
) -> None:
    (tmp_path / "reference").mkdir()
    _, reference = _launch(tmp_path / "reference", engine, async_save, [])
    points = _kills(async_save)
    project = tmp_path / "killed"
    project.mkdir()
    specs = [f"{index}:{rank}:{step}:{where}" for index, (rank, step, where) in enumerate(points)]
    output, final = _launch(project, engine, async_save, specs)

    markers = [json.loads((project / "kills" / str(i)).read_text()) for i in range(len(points))]
    assert [m["where"] for m in markers] == [where for _, _, where in points], output[-4000:]
    resumes = {(event["attempt"], event["rank"]): event for event in _events(output, "RESUMED")}
    assert sorted({attempt for attempt, _ in resumes}) == [0, 1, 2, 3], output[-4000:]
    assert resumes[(0, 0)]["checkpoint"] is None
    for attempt in (1, 2, 3):
        first, second = resumes[(attempt, 0)], resumes[(attempt, 1)]
        assert first["checkpoint"] == second["checkpoint"]  # both ranks load the same one
        assert first["batches_seen"] == second["batches_seen"]
        marker = markers[attempt - 1]
        seen = int(marker["seen"])  # type: ignore[call-overload]
        # A kill at a step comes before that step's save: the newest save is from a step
        # before it, complete unless it was still being written (then the one before that).
        last_save = (seen - 1) // SAVE_EVERY * SAVE_EVERY
        allowed = {last_save}
        if marker["where"] == "write":  # the save taken at the chosen step never completed
            allowed = {points[attempt - 1][1] - SAVE_EVERY}
        elif marker["in_flight"]:
            allowed = {last_save, last_save - SAVE_EVERY}
        assert first["batches_seen"] in allowed, (attempt, marker, first)
        LOST.append(seen - int(first["batches_seen"]))  # type: ignore[call-overload]
    if async_save:  # training ran while the killed write was in flight
        assert int(markers[1]["seen"]) > points[1][1]  # type: ignore[call-overload]
    ends = _events(output, "END")
    assert [end["attempt"] for end in ends] == [3] and ends[0]["seen"] == TOTAL

    print(f"{engine}: kills {markers}, micro-steps redone {LOST[-3:]}")
    want, got = load_file(reference), load_file(final)
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].equal(got[name]), name
    checkpoints = sorted(p.name for p in (project / "checkpoints").iterdir())
    last = TOTAL // SAVE_EVERY - 1  # total_limit=3 keeps the last three, nothing hidden
    assert checkpoints == [f"checkpoint_{n}" for n in (last - 2, last - 1, last)]
