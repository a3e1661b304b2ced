"""Crash-safe checkpoints under torchrun: resumed runs equal uninterrupted ones, bit for bit.

Every run is ``scripts/resume_run.py`` on 2 CPU processes: an MLP with dropout, AdamW,
StepLR, a shuffled seedable loader, gradient accumulation 2, ``save_state()`` every few
micro-steps with automatic naming and ``total_limit=2``. Rank 0 writes a trace (loss and a
digest of the weights after every micro-step) and the final weights, which are compared with
an uninterrupted run's.

The fault test SIGKILLs one rank at points drawn by ``random.Random(SEED)``: right after a
training step, or inside a save before / between / after the file writes, after the manifest
and after the rename (before ``total_limit`` pruning). After each kill the checkpoints folder
must hold exactly the complete checkpoints expected (each with a manifest matching its files,
its weights those of the reference at its step), plus at most hidden ``.incomplete``
directories newer than all of them. To keep the number of launches (about 15 s each on a
2-core machine) down, the kill points run in chains: the run after a kill resumes *and* is
killed at the next point; the last run of a chain resumes to the end. Every resumed run's
trace must match the reference at every step it ran, so a wrong resume is pinned to the kill
that preceded it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

SEED = 20240917
TOTAL = 36  # micro-steps; 3 epochs of 12 batches per rank
ACCUMULATION = 2
TOTAL_LIMIT = 2
KILL_CHAINS = ((3, 5), (5, 5))  # (save_every, kill points) per chain
TIMEOUT = 240.0

_REFERENCES: dict[str, Reference] = {}


# ------------------------------------------------------------------------------------------
# Running the script
# ------------------------------------------------------------------------------------------


@dataclass
class Run:
    args: list[str]
    returncode: int
    output: str
    events: list[dict[str, Any]]
    trace: list[dict[str, Any]]
    weights: Path

    def describe(self) -> str:
        return f"resume_run.py {' '.join(self.args)}\n--- output ---\n{self.output[-6000:]}"

    def event(self, name: str) -> dict[str, Any]:
        found = [e for e in self.events if e.get("event") == name]
        assert found, f"no {name!r} line in the output of\n{self.describe()}"
        return found[-1]


@dataclass
class Reference:
    weights: dict[str, torch.Tensor]
    trace: dict[int, dict[str, Any]]


@dataclass
class Launcher:
    run_torchrun: Any
    project: Path
    save_every: int
    mixed_precision: str = "no"
    runs: int = field(default=0)

    def __call__(self, total: int = TOTAL, resume: bool = False, kill: str | None = None) -> Run:
        self.runs += 1
        trace = self.project.parent / f"{self.project.name}.trace{self.runs}.jsonl"
        out = self.project.parent / f"{self.project.name}.weights{self.runs}.safetensors"
        args = [
            "--project-dir",
            str(self.project),
            "--total-steps",
            str(total),
            "--save-every",
            str(self.save_every),
            "--accumulation",
            str(ACCUMULATION),
            "--mixed-precision",
            self.mixed_precision,
            "--trace",
            str(trace),
            "--out",
            str(out),
        ]
        if resume:
            args.append("--resume")
        if kill is not None:
            args += ["--kill-at", kill]
        done = self.run_torchrun("resume_run.py", *args, timeout=TIMEOUT)
        lines = trace.read_text().splitlines() if trace.exists() else []
        return Run(
            args=args,
            returncode=done.returncode,
            output=done.stdout + done.stderr,
            events=[json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")],
            trace=[json.loads(ln) for ln in lines],
            weights=out,
        )


def reference(run_torchrun, tmp_path_factory, mixed_precision: str = "no") -> Reference:
    """The uninterrupted run (saving every 6 micro-steps), once per module and precision."""
    if mixed_precision not in _REFERENCES:
        root = tmp_path_factory.mktemp(f"reference-{mixed_precision}")
        launch = Launcher(run_torchrun, root / "project", 6, mixed_precision)
        run = launch()
        assert run.returncode == 0, run.describe()
        assert run.event("end")["saves"] == [f"checkpoint_{i}" for i in range(TOTAL // 6)]
        assert [line["n"] for line in run.trace] == list(range(1, TOTAL + 1)), run.describe()
        _REFERENCES[mixed_precision] = Reference(
            weights=load_file(run.weights), trace={line["n"]: line for line in run.trace}
        )
    return _REFERENCES[mixed_precision]


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------


def weights_difference(path: Path, expected: dict[str, torch.Tensor]) -> str | None:
    """``None`` if the weights in ``path`` are bit-identical to ``expected``."""
    if not path.exists():
        return f"{path} was not written"
    got = load_file(path)
    if sorted(got) != sorted(expected):
        return f"tensor names differ: {sorted(got)} != {sorted(expected)}"
    for name in sorted(expected):
        a, b = got[name], expected[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else None
            return f"tensor {name!r} differs from the reference (max |diff| {gap})"
    return None


def trace_difference(run: Run, ref: Reference) -> str | None:
    """``None`` if every micro-step the run made matches the reference's same step."""
    for line in run.trace:
        want = ref.trace.get(line["n"])
        if want != line:
            return f"micro-step {line['n']}: {line} but the uninterrupted run had {want}"
    return None


def digest(state: dict[str, torch.Tensor]) -> str:
    """The script's weight digest (``resume_run.digest``) of a state dict."""
    sha = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        sha.update(name.encode())
        sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def inspect_checkpoints(
    project: Path, save_every: int, ref: Reference
) -> tuple[list[int], list[int], list[str]]:
    """(complete checkpoint numbers, hidden .incomplete numbers, problems found)."""
    base = project / "checkpoints"
    complete: list[int] = []
    hidden: list[int] = []
    problems: list[str] = []
    if not base.exists():
        return complete, hidden, problems
    for entry in sorted(base.iterdir()):
        if match := re.fullmatch(r"\.checkpoint_(\d+)\.incomplete", entry.name):
            hidden.append(int(match[1]))
            continue
        match = re.fullmatch(r"checkpoint_(\d+)", entry.name)
        if match is None or not entry.is_dir():
            problems.append(f"unexpected entry {entry.name}")
            continue
        number = int(match[1])
        complete.append(number)
        manifest = entry / "accel_manifest.json"
        if not manifest.exists():
            problems.append(f"{entry.name} has no accel_manifest.json")
            continue
        listed = json.loads(manifest.read_text())["files"]
        present = {p.name: p.stat().st_size for p in entry.iterdir() if p != manifest}
        if {name: meta["size"] for name, meta in listed.items()} != present:
            problems.append(f"{entry.name}: manifest {listed} but files {present}")
            continue
        step = save_every * (number + 1)
        counter = torch.load(entry / "custom_checkpoint_0.pkl", weights_only=True)
        if counter != {"n": step}:
            problems.append(f"{entry.name} holds counter {counter}, expected n={step}")
        weights = {
            k.removeprefix("module."): v for k, v in load_file(entry / "model.safetensors").items()
        }
        if digest(weights) != ref.trace[step]["weights"]:
            problems.append(f"{entry.name}: its weights are not the reference's at step {step}")
    return sorted(complete), sorted(hidden), problems


# ------------------------------------------------------------------------------------------
# Kill points
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: after micro-step ``step`` (``k is None``) or inside the save at ``step``."""

    step: int
    rank: int
    k: int | None
    save_every: int

    @property
    def spec(self) -> str:
        if self.k is None:
            return f"train:{self.step}:{self.rank}"
        return f"save:{self.step}:{self.k}:{self.rank}"

    @property
    def window_open(self) -> bool:
        return self.step % ACCUMULATION != 0

    def files(self) -> int:
        """Files this rank writes in the save (rank 0: 6 and the manifest; rank 1: 1)."""
        return (6 if self.rank == 0 else 1) + (1 if self.window_open else 0)

    def events(self) -> int:
        """The save's patched calls on this rank: its files, then manifest and rename."""
        return self.files() + (2 if self.rank == 0 else 0)

    @property
    def commits(self) -> bool:
        """The kill lands after the rename (before pruning): the checkpoint is complete."""
        return self.k is not None and self.rank == 0 and self.k == self.events()

    def phase(self) -> str:
        if self.k is None:
            return f"rank {self.rank} after a training step"
        files = self.files()
        where = "mid-window " if self.window_open else ""
        if self.k == 0:
            what = "before any file"
        elif self.k < files:
            what = f"after file {self.k} of {files}"
        elif self.k == files:
            what = "after the files, before the manifest" if self.rank == 0 else "after its files"
        elif self.k == files + 1:
            what = "after the manifest, before the rename"
        else:
            what = "after the rename, before pruning"
        return f"{where}save, rank {self.rank} {what}"

    def label(self) -> str:
        return f"{self.spec} ({self.phase()})"


def draw_chain(rng: random.Random, save_every: int, count: int) -> list[Kill]:
    """``count`` kill points at distinct, increasing micro-steps (each reachable after a resume)."""
    saves = list(range(save_every, TOTAL + 1, save_every))
    chosen: dict[int, Kill] = {}
    while len(chosen) < count:
        rank = rng.choice((0, 0, 1))
        if rng.random() < 0.3:
            step = rng.randrange(1, TOTAL)
            kill = Kill(step, rank, None, save_every)
        else:
            step = rng.choice(saves)
            probe = Kill(step, rank, 0, save_every)
            kill = Kill(step, rank, rng.randrange(probe.events() + 1), save_every)
        chosen.setdefault(step, kill)
    return [chosen[step] for step in sorted(chosen)]


def kill_plan(seed: int) -> list[list[Kill]]:
    """Chains drawn by ``random.Random(seed)``, redrawn until every kind of point is covered."""
    rng = random.Random(seed)
    wanted = {
        "rank 1 after a training step",
        "rank 0 before any file",
        "after file",
        "before the manifest",
        "before the rename",
        "after the rename",
        "rank 1",
        "mid-window",
    }
    while True:
        chains = [draw_chain(rng, save_every, count) for save_every, count in KILL_CHAINS]
        phases = " | ".join(kill.phase() for chain in chains for kill in chain)
        if all(kind in phases for kind in wanted):
            return chains


def expected_after(
    complete: list[int], save_every: int, total: int, kill: Kill | None
) -> tuple[list[int], int | None]:
    """Complete checkpoints after a run resumed from ``complete``; and the save it died in."""
    have = list(complete)
    start = save_every * (max(have) + 1) if have else 0
    dying = None
    for step in range(start + save_every, total + 1, save_every):
        number = step // save_every - 1
        if kill is not None and step >= kill.step:
            if step == kill.step and kill.k is not None:
                if kill.commits:
                    have.append(number)  # renamed into place, not pruned yet
                else:
                    dying = number
            break
        have = sorted([*have, number])[-TOTAL_LIMIT:]
    return sorted(have), dying


PLAN = kill_plan(SEED)


def killed_rank(output: str) -> tuple[int, int] | None:
    """(rank, exit code) of torchrun's root-cause failure."""
    _, _, root = output.partition("Root Cause")
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    return (int(rank[1]), int(code[1])) if rank and code else None


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mixed_precision", "save_every", "stops"),
    # fp32 resumes at many points (epoch boundary, mid-window) in the kill chains below;
    # this case adds bf16, resuming from a checkpoint taken inside an accumulation window.
    [pytest.param("bf16", 5, (17,), id="bf16-stop17-mid-window")],
)
def test_uninterrupted_vs_resumed_is_bit_identical(
    run_torchrun, tmp_path, tmp_path_factory, mixed_precision, save_every, stops
) -> None:
    """Stop after ``k`` micro-steps, resume from the newest checkpoint: same final weights.

    The bf16 case saves every 5 micro-steps and stops at 17, so it resumes from a checkpoint
    taken in the middle of an accumulation window (15), with its partial gradients.
    """
    ref = reference(run_torchrun, tmp_path_factory, mixed_precision)
    launch = Launcher(run_torchrun, tmp_path / "project", save_every, mixed_precision)
    complete: list[int] = []
    for number, stop in enumerate([*stops, TOTAL]):
        run = launch(total=stop, resume=number > 0)
        context = f"[{mixed_precision}] run {number} to {stop}\n{run.describe()}"
        assert run.returncode == 0, context
        start = save_every * (max(complete) + 1) if complete else 0
        assert run.event("start") == {
            "event": "start",
            "loaded": f"checkpoint_{max(complete)}" if complete else None,
            "start": start,
        }, context
        assert [line["n"] for line in run.trace] == list(range(start + 1, stop + 1)), context
        assert trace_difference(run, ref) is None, trace_difference(run, ref) + "\n" + context
        complete, _ = expected_after(complete, save_every, stop, None)
        found, hidden, problems = inspect_checkpoints(launch.project, save_every, ref)
        assert (found, hidden, problems) == (complete, [], []), context
    assert weights_difference(run.weights, ref.weights) is None, (
        f"[{mixed_precision}] stops at {stops}: "
        + str(weights_difference(run.weights, ref.weights))
    )


@dataclass
class ChainResult:
    """What one kill chain exercised, and the first check it failed (``None``: all passed)."""

    exercised: list[tuple[str, str]] = field(default_factory=list)  # (kill point, outcome)
    failure: str | None = None


_CHAINS: dict[int, ChainResult] = {}


def chain_result(run_torchrun, tmp_path_factory, chain: list[Kill]) -> ChainResult:
    """Run one kill chain once per module (a cache: whichever test asks first runs it)."""
    save_every = chain[0].save_every
    if save_every not in _CHAINS:
        result = ChainResult()
        root = tmp_path_factory.mktemp(f"chain-save-every-{save_every}")
        launch = Launcher(run_torchrun, root / "project", save_every)
        try:
            run_chain(launch, chain, reference(run_torchrun, tmp_path_factory), result.exercised)
        except AssertionError as error:
            result.failure = str(error)
        _CHAINS[save_every] = result
    return _CHAINS[save_every]


def run_chain(
    launch: Launcher, chain: list[Kill], ref: Reference, exercised: list[tuple[str, str]]
) -> None:
    """SIGKILL one rank at each point of the chain, then resume to the end; assert each step.

    Appends each kill point to ``exercised`` as it is checked, with how far it got.
    """
    save_every = launch.save_every
    complete: list[int] = []
    history: list[str] = []
    for kill in chain:
        where = f"kill point {kill.label()} (after {history or 'a fresh start'})"
        run = launch(resume=True, kill=kill.spec)
        context = f"{where}\n{run.describe()}"
        assert run.returncode != 0, f"{where}: the run was not killed\n{context}"
        assert "the save had only" not in run.output, f"{where}: no such save event\n{context}"
        assert killed_rank(run.output) == (kill.rank, -9), f"{where}: wrong failure\n{context}"
        start = save_every * (max(complete) + 1) if complete else 0
        assert run.event("start")["loaded"] == (
            f"checkpoint_{max(complete)}" if complete else None
        ), f"{where}: loaded the wrong checkpoint\n{context}"
        assert run.event("start")["start"] == start, context
        problem = trace_difference(run, ref)
        assert problem is None, f"{where}: the resumed run diverged: {problem}\n{context}"

        complete, dying = expected_after(complete, save_every, TOTAL, kill)
        found, hidden, problems = inspect_checkpoints(launch.project, save_every, ref)
        assert not problems, f"{where}: {problems}\n{context}"
        assert found == complete, (
            f"{where}: complete checkpoints {found}, expected {complete}\n{context}"
        )
        assert all(number > max(complete, default=-1) for number in hidden), (
            f"{where}: stale hidden directories {hidden} next to {found}\n{context}"
        )
        if dying is not None:
            assert dying in hidden, f"{where}: no .checkpoint_{dying}.incomplete\n{context}"
        history.append(kill.spec)
        exercised.append((kill.label(), "killed; checkpoints sound"))

    run = launch(resume=True)
    where = f"final resume after kills {history}"
    context = f"{where}\n{run.describe()}"
    assert run.returncode == 0, context
    assert run.event("start")["loaded"] == (f"checkpoint_{max(complete)}" if complete else None), (
        context
    )
    problem = trace_difference(run, ref)
    assert problem is None, f"{where}: the resumed run diverged: {problem}\n{context}"
    complete, _ = expected_after(complete, save_every, TOTAL, None)
    assert inspect_checkpoints(launch.project, save_every, ref) == (complete, [], []), context
    problem = weights_difference(run.weights, ref.weights)
    assert problem is None, f"{where}: final weights: {problem}\n{context}"
    exercised[:] = [(label, "killed; checkpoints sound; resume exact") for label, _ in exercised]


@pytest.mark.parametrize(
    "chain",
    [pytest.param(chain, id=f"save-every-{chain[0].save_every}") for chain in PLAN],
)
def test_kill_minus_nine_at_random_points(
    run_torchrun, tmp_path_factory, chain: list[Kill]
) -> None:
    """SIGKILL one rank at each point of the chain; the checkpoints stay sound; resume is exact."""
    result = chain_result(run_torchrun, tmp_path_factory, chain)
    assert result.failure is None, result.failure


def test_kill_points_summary(run_torchrun, tmp_path_factory) -> None:
    """At least 10 kill points ran, each resumed to bit-identical weights.

    Runs every chain of the plan that no test of this module has run yet, so it holds alone
    (``-k summary``), in any order and in any xdist worker.
    """
    exercised = [
        entry
        for chain in PLAN
        for entry in chain_result(run_torchrun, tmp_path_factory, chain).exercised
    ]
    summary = "\n".join(f"  {label}: {outcome}" for label, outcome in exercised)
    print(f"\n{len(exercised)} kill points exercised:\n{summary}")
    exact = [label for label, outcome in exercised if outcome.endswith("resume exact")]
    assert len(exact) >= 10, f"only {len(exact)} kill points resumed exactly:\n{summary}"
