"""Run HuggingFace Accelerate 1.15's own test suite against accel (or, to calibrate, Accelerate).

    python tools/upstream_suite.py --lib accel          # the renamed suite against accel
    python tools/upstream_suite.py --lib accelerate     # the same selection against Accelerate
    python tools/upstream_suite.py --report             # docs/compat.md table from both runs
    python tools/upstream_suite.py --check-report       # fail if that table is stale
    python tools/upstream_suite.py --lib accel --gpu --sdist accelerate-1.15.0.tar.gz
                                    # the GPU-gated tests only, from a given sdist (offline)

Steps, each written down once here:

1. Download ``accelerate==1.15.0``'s source distribution from the package index (``pip
   download --no-binary``; cached in ``.upstream/``). It holds ``tests/`` and
   ``src/accelerate/test_utils/`` (the test programs under ``test_utils/scripts/``).
2. Extract them into ``.upstream/<lib>/``. For ``--lib accel`` apply :func:`rename` to every
   Python file: the one mechanical rename a migrating user applies (``accelerate`` -> ``accel``
   as a word, ``ACCELERATE_`` -> ``ACCEL_``, ``accelerate_`` at the start of a word ->
   ``accel_``). Accelerate's test programs are not part of accel, so the extracted, renamed
   ``test_utils/scripts`` is served as ``accel.test_utils.scripts`` by the pytest plugin
   (``tools/upstream/accel_upstream_plugin.py``); ``accel.test_utils`` itself is accel's own.
3. Run the pytest files of :data:`TEST_FILES` in one pytest process, with the
   adaptations of ``tools/upstream/adaptations.toml`` (tests Accelerate itself cannot pass on a
   2-core CPU machine without network, each with its reason) deselected for both libraries.
4. Run the multi-process test programs of :data:`SCRIPTS` on 2 CPU processes, each with a
   timeout: ``accel launch --cpu --num_processes 2`` for accel; for Accelerate the command
   that really starts 2 gloo processes (``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu
   --num_processes 2``: its ``--cpu --num_processes 2`` starts one). Accelerate's processes
   get ``upstream/reference_exit/sitecustomize.py``, which releases the process groups at exit
   as accel does itself; without it a passing program can abort in finalization (torch's gloo
   threads, pytorch/pytorch#190489) and count as failed.
5. Write ``.upstream/results-<lib>.json`` and compare: for Accelerate every selected test must
   pass or skip (the harness is fair); for accel every failure must be listed in
   ``tools/upstream/expected.toml`` with the ``docs/compat.md`` row that explains it, and every
   listed test must still fail (a stale entry fails the run).

``--gpu`` (tools/gpu_check.py, on a machine with a GPU) runs, from the same files, only the
tests that Accelerate gates on an accelerator with a decorator of :data:`GPU_GATES` (on the test
or on its class), and none of the 2-process CPU programs: the tests that skip on a CPU machine.
Its run folders and results are ``.upstream/<lib>-gpu/`` and ``results-<lib>-gpu.json``, so
the CPU runs behind docs/compat.md's table are left alone; expectations are checked for the
tests that ran. ``--sdist PATH`` uses a given copy of the sdist instead of downloading one (a
machine without network), and ``--timeout`` bounds the pytest run.

Standard library only; the interpreter given with ``--python`` needs pytest and the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tools" / "upstream"
WORK = ROOT / ".upstream"
VERSION = "1.15.0"
ADAPTATIONS = HERE / "adaptations.toml"
EXPECTED = HERE / "expected.toml"
COMPAT = ROOT / "docs" / "compat.md"
CONSTRAINTS = ROOT / "tools" / "constraints" / "ci.txt"
LIBS = ("accel", "accelerate")

#: Every pytest file of the sdist that can run on a 2-core CPU machine offline. Left out:
#: test_examples.py (it reads the repository's examples/ folder, which the sdist lacks).
TEST_FILES: tuple[str, ...] = (
    "test_accelerator.py",
    "test_activation_checkpointing_offload.py",
    "test_big_modeling.py",
    "test_cli.py",
    "test_compile.py",
    "test_cpu.py",
    "test_data_loader.py",
    "test_dataclasses.py",
    "test_fp8.py",
    "test_grad_sync.py",
    "test_hooks.py",
    "test_imports.py",
    "test_kwargs_handlers.py",
    "test_launch.py",
    "test_load_checkpoint_and_dispatch_with_broadcast.py",
    "test_logging.py",
    "test_memory_utils.py",
    "test_metrics.py",
    "test_modeling_utils.py",
    "test_multidevice.py",
    "test_offload.py",
    "test_optimizer.py",
    "test_quantization.py",
    "test_sagemaker.py",
    "test_scheduler.py",
    "test_state_checkpointing.py",
    "test_tpu.py",
    "test_tracking.py",
    "test_utils.py",
)

#: The multi-process test programs under test_utils/scripts/ that Accelerate 1.15 passes on 2
#: CPU processes here. Left out: test_ddp_comm_hook.py (passes GPU device ids to DDP),
#: test_notebook.py (needs several GPUs), test_merge_weights.py (FSDP),
#: external_deps/* (hub models and datasets).
SCRIPTS: tuple[str, ...] = ("test_script.py", "test_ops.py", "test_sync.py", "test_cli.py")
#: Programs run for accel only, because Accelerate 1.15 cannot pass them here; each is a
#: documented difference. test_distributed_data_loop.py hangs under Accelerate on CPU
#: (``join_uneven_inputs`` is a no-op there, so uneven batches deadlock DDP).
ACCEL_ONLY_SCRIPTS: tuple[str, ...] = ("test_distributed_data_loop.py",)
SCRIPT_TIMEOUT = 180.0  # each program takes under 10 s here
PYTEST_TIMEOUT = 900.0
#: The decorators of Accelerate's ``test_utils.testing`` that skip a test without an
#: accelerator; ``--gpu`` runs the tests carrying one of them (the pytest plugin selects them).
GPU_GATES: tuple[str, ...] = (
    "require_non_cpu",
    "require_cuda",
    "require_cuda_or_hpu",
    "require_cuda_or_xpu",
    "require_single_device",
    "require_single_gpu",
    "require_multi_device",
    "require_multi_gpu",
    "require_multi_gpu_or_xpu",
)

# --- 1-2. the sources and the rename ------------------------------------------------------

_WORD = re.compile(r"\baccelerate\b")
_PREFIX_UPPER = re.compile(r"\bACCELERATE_")
_PREFIX_LOWER = re.compile(r"\baccelerate_")


def rename(text: str) -> str:
    """The mechanical rename: what a user does to move a script from Accelerate to accel.

    ``accelerate`` as a whole word becomes ``accel`` (imports, dotted names in strings such as
    ``patch("accelerate.utils.x")`` and logger names, the command name); ``ACCELERATE_``
    starting a word becomes ``ACCEL_`` (environment variables); ``accelerate_`` starting a word
    becomes ``accel_`` (lower-case variable names such as ``patch_environment(
    accelerate_debug_mode=1)``). Names that merely contain the word stay
    (``path_in_accelerate_package``, ``AccelerateTestCase``, ``_is_accelerate_prepared``):
    they are Accelerate's public names, which accel keeps.
    """
    text = _PREFIX_UPPER.sub("ACCEL_", text)
    text = _PREFIX_LOWER.sub("accel_", text)
    return _WORD.sub("accel", text)


def cached_sdist() -> Path | None:
    """The sdist a previous run downloaded, or None."""
    path = WORK / "download" / f"accelerate-{VERSION}.tar.gz"
    return path if path.is_file() else None


def download_sdist(python: str) -> Path:
    """The cached sdist, downloaded with ``python -m pip`` the first time."""
    folder = WORK / "download"
    cached = cached_sdist()
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    # pip's bar on a terminal (unless ACCEL_DISABLE_PROGRESS_BAR), nothing in a log or CI
    disabled = os.environ.get("ACCEL_DISABLE_PROGRESS_BAR", "").strip().lower()
    terminal = sys.stderr.isatty() and disabled not in ("1", "true", "yes", "on", "y", "t")
    shown = ["--progress-bar", "on"] if terminal else ["--quiet", "--progress-bar", "off"]
    command = [
        python,
        "-m",
        "pip",
        "download",
        *shown,
        "--no-deps",
        "--no-binary",
        ":all:",
        "--dest",
        str(folder),
        f"accelerate=={VERSION}",
    ]
    subprocess.run(command, check=True)
    found = sorted(folder.glob(f"accelerate-{VERSION}.tar.gz"))
    if not found:
        raise SystemExit(f"upstream_suite: pip download left no accelerate-{VERSION}.tar.gz")
    return found[0]


def extract(sdist: Path, lib: str, folder: str | None = None) -> Path:
    """Extract tests/ and the test programs into ``.upstream/<folder or lib>/`` (renamed for accel).

    The programs (``src/accelerate/test_utils/scripts/``) go to ``overlay/scripts/``; the rest
    of Accelerate's ``test_utils`` is not extracted: accel's own ``accel.test_utils`` is under
    test, and the calibration uses the installed Accelerate's.

    Raises:
        SystemExit: ``sdist`` is not a tar archive of the sources of accelerate==VERSION.
    """
    dest = WORK / (folder or lib)
    if dest.exists():
        shutil.rmtree(dest)
    prefix = f"accelerate-{VERSION}/"
    wanted = {"tests/": "tests/", "src/accelerate/test_utils/scripts/": "overlay/scripts/"}
    try:
        archive = tarfile.open(sdist)
    except (OSError, tarfile.TarError) as error:
        raise SystemExit(f"upstream_suite: cannot read the sdist {sdist}: {error}") from None
    with archive:
        for member in archive.getmembers():
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            inner = member.name[len(prefix) :]
            for source, target in wanted.items():
                if inner.startswith(source):
                    path = dest / (target + inner[len(source) :])
                    break
            else:
                continue
            handle = archive.extractfile(member)
            assert handle is not None
            data = handle.read()
            path.parent.mkdir(parents=True, exist_ok=True)
            if lib == "accel" and path.suffix == ".py":
                data = rename(data.decode("utf-8")).encode("utf-8")
            path.write_bytes(data)
    if not (dest / "tests").is_dir():
        raise SystemExit(
            f"upstream_suite: {sdist} holds no {prefix}tests/: give accelerate-{VERSION}.tar.gz, "
            f"the source distribution of accelerate=={VERSION}"
        )
    # The run's own rootdir: nothing of this repository's pytest configuration applies.
    (dest / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return dest


# --- 3. pytest ---------------------------------------------------------------------------


def gpu_files(dest: Path) -> tuple[str, ...]:
    """The files of :data:`TEST_FILES` in ``dest/tests`` that use one of :data:`GPU_GATES`."""
    gate = re.compile(r"@(?:" + "|".join(GPU_GATES) + r")\b")
    return tuple(
        name
        for name in TEST_FILES
        if (dest / "tests" / name).is_file()
        and gate.search((dest / "tests" / name).read_text(encoding="utf-8"))
    )


def _environment(python: str, lib: str, dest: Path) -> dict[str, str]:
    # Accelerate's processes get accel's exit-time release of the process groups (see
    # upstream/reference_exit/sitecustomize.py): without it one may abort after passing.
    paths = [str(HERE)] + ([str(HERE / "reference_exit")] if lib == "accelerate" else [])
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ACCEL_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))
    }
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH", "")])),
        # The interpreter's scripts folder first, as in an activated virtualenv.
        PATH=os.pathsep.join(filter(None, [str(Path(python).parent), env.get("PATH", "")])),
        ACCEL_UPSTREAM_LIB=lib,
        ACCEL_UPSTREAM_DIR=str(dest),
        ACCEL_UPSTREAM_ADAPTATIONS=str(ADAPTATIONS),
    )
    # Keep the user's config files out of the run.
    env["HF_HOME"] = str(dest / "hf-home")
    env["ACCEL_HOME"] = str(dest / "accel-home")
    env["HOME"] = str(dest / "home")
    return env


def run_pytest(
    python: str,
    lib: str,
    dest: Path,
    files: tuple[str, ...] = TEST_FILES,
    gpu: bool = False,
    timeout: float = PYTEST_TIMEOUT,
) -> dict[str, dict[str, str]]:
    """Run the selected files; return ``{node id: {"outcome": ..., "message": ...}}``.

    With ``gpu``, the plugin keeps only the tests gated by one of :data:`GPU_GATES`.
    """
    command = [
        python,
        "-m",
        "pytest",
        "-p",
        "accel_upstream_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        "--continue-on-collection-errors",
        *(f"tests/{name}" for name in files),
    ]
    env = _environment(python, lib, dest)
    if gpu:
        env.update(ACCEL_UPSTREAM_SELECT="gpu", ACCEL_UPSTREAM_GPU_GATES=",".join(GPU_GATES))
    (dest / "home").mkdir(exist_ok=True)
    log = dest / "pytest.log"
    start = time.monotonic()
    (dest / "pytest-results.json").unlink(missing_ok=True)
    cut = _run_logged(command, dest, env, log, timeout) is None
    if cut:
        print(f"upstream_suite: pytest ran past {timeout:.0f} s; see {log}")
    print(f"upstream_suite: pytest ({lib}) took {time.monotonic() - start:.0f} s; log {log}")
    recorded = dest / "pytest-results.json"
    if not recorded.exists():
        raise SystemExit(f"upstream_suite: pytest recorded no results; see {log}")
    results: dict[str, dict[str, str]] = json.loads(recorded.read_text(encoding="utf-8"))
    if not results:
        raise SystemExit(f"upstream_suite: pytest ran no test; see {log}")
    if cut:  # the tests it did not reach count as one failure
        message = f"pytest ran past {timeout:.0f} s and was stopped"
        results[f"tests (pytest ran past {timeout:.0f} s)"] = {
            "outcome": "failed",
            "message": message,
        }
    return results


def _run_logged(
    command: list[str], cwd: Path, env: Mapping[str, str], log: Path, timeout: float
) -> int | None:
    """Run ``command`` with its output in ``log``; its exit code, or None past ``timeout``."""
    with log.open("w", encoding="utf-8") as out:
        # A session of its own: past the timeout the whole group goes (launcher and ranks).
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


# --- 4. the multi-process programs -----------------------------------------------------


def _launch_command(python: str, lib: str) -> list[str]:
    if lib == "accel":
        return [python, "-m", "accel_launch", "launch", "--cpu", "--num_processes", "2", "-q"]
    return [
        python,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--monitor_interval",
        "0.1",
    ]


def run_scripts(python: str, lib: str, dest: Path) -> dict[str, dict[str, str]]:
    """Run each program on 2 CPU processes; outcomes by ``scripts/<name>``."""
    results: dict[str, dict[str, str]] = {}
    names = SCRIPTS + (ACCEL_ONLY_SCRIPTS if lib == "accel" else ())
    env = _environment(python, lib, dest)
    if lib == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"  # with --multi_gpu: 2 gloo processes
    for name in names:
        script = dest / "overlay" / "scripts" / name
        log = dest / f"script-{name}.log"
        start = time.monotonic()
        command = [*_launch_command(python, lib), str(script)]
        code = _run_logged(command, dest, env, log, SCRIPT_TIMEOUT)
        if code is None:
            # torch's DataLoader workers, forked from a process whose gloo threads run, hang
            # now and then before their first batch (test_distributed_data_loop.py: 2 of 30
            # runs on this machine, accel and Accelerate code alike): a program that runs past
            # the timeout gets one more run; a real hang hangs again.
            retry_log = log.with_suffix(".retry.log")
            print(
                f"upstream_suite: {name} ({lib}): ran past {SCRIPT_TIMEOUT:.0f} s (log {log}); "
                f"running it once more (log {retry_log})"
            )
            code = _run_logged(command, dest, env, retry_log, SCRIPT_TIMEOUT)
        if code is None:
            outcome, message = "failed", f"ran past {SCRIPT_TIMEOUT:.0f} s"
        else:
            outcome, message = ("passed" if code == 0 else "failed"), f"exit code {code}"
        took = time.monotonic() - start
        print(f"upstream_suite: {name} ({lib}): {outcome} in {took:.0f} s; log {log}")
        results[f"scripts/{name}"] = {"outcome": outcome, "message": message}
    return results


# --- 5. comparison ------------------------------------------------------------------------


def load_expected(path: Path = EXPECTED) -> dict[str, dict[str, str]]:
    """``{test id: {"compat": row text, "why": reason}}`` from the expectation file."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    expected: dict[str, dict[str, str]] = {}
    for entry in data.get("failure", []):
        for test_id in entry["tests"]:
            if test_id in expected:
                raise SystemExit(f"upstream_suite: {test_id} is listed twice in {path}")
            expected[test_id] = {"compat": entry["compat"], "why": entry["why"]}
    return expected


def compare(
    lib: str,
    results: Mapping[str, Mapping[str, str]],
    expected: Mapping[str, Mapping[str, str]],
    compat_text: str,
    partial: bool = False,
) -> list[str]:
    """Every problem with a run, as lines; empty means the run matches its expectations.

    ``partial``: the run was a selection (``--gpu``); a listed test it did not run is not stale.
    """
    problems = []
    failed = sorted(test for test, result in results.items() if result["outcome"] == "failed")
    if lib == "accelerate":
        for test in failed:
            problems.append(
                f"unfair harness: Accelerate itself fails {test} "
                f"({results[test]['message']}); deselect it in {ADAPTATIONS.name} with a reason"
            )
        return problems
    for test in failed:
        if test not in expected:
            problems.append(f"unexpected failure: {test}: {results[test]['message']}")
    for test, entry in sorted(expected.items()):
        if entry["compat"] not in compat_text:
            problems.append(f"{test}: its compat row {entry['compat']!r} is not in docs/compat.md")
        outcome = results.get(test, {}).get("outcome")
        if outcome is None and partial:
            continue
        if outcome is None:
            problems.append(f"stale entry: {test} did not run (renamed or deselected?)")
        elif outcome != "failed":
            problems.append(f"stale entry: {test} now {outcome}; remove it from {EXPECTED.name}")
    return problems


def summarise(results: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, int]]:
    """Counts of passed / failed / skipped per file (``scripts`` counted as one file)."""
    table: dict[str, dict[str, int]] = {}
    for test, result in results.items():
        key = test.split("::", 1)[0] if not test.startswith("scripts/") else "scripts (2 processes)"
        counts = table.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
        counts[result["outcome"]] += 1
    return dict(sorted(table.items()))


_BEGIN = "<!-- upstream-suite:begin -->"
_END = "<!-- upstream-suite:end -->"


def report_table() -> str:
    """The markdown table of both runs, file by file."""
    runs = {}
    for lib in LIBS:
        path = WORK / f"results-{lib}.json"
        if not path.exists():
            raise SystemExit(f"upstream_suite: no {path}; run --lib {lib} first")
        runs[lib] = summarise(json.loads(path.read_text(encoding="utf-8"))["results"])
    files = sorted(set(runs["accel"]) | set(runs["accelerate"]))
    lines = [
        "| file | Accelerate 1.15 passed / failed / skipped | accel passed / failed / skipped |",
        "|---|---|---|",
    ]
    totals = {lib: {"passed": 0, "failed": 0, "skipped": 0} for lib in LIBS}
    for name in files:
        cells = []
        for lib in ("accelerate", "accel"):
            counts = runs[lib].get(name)
            if counts is None:
                cells.append("not run")
                continue
            for key in totals[lib]:
                totals[lib][key] += counts[key]
            cells.append(f"{counts['passed']} / {counts['failed']} / {counts['skipped']}")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    total = [
        f"{t['passed']} / {t['failed']} / {t['skipped']}"
        for t in (totals["accelerate"], totals["accel"])
    ]
    lines.append(f"| **total** | **{total[0]}** | **{total[1]}** |")
    lines += ["", "The tests accel fails on purpose (`tools/upstream/expected.toml`):", ""]
    lines += ["| test | why | the row of this file that explains it |", "|---|---|---|"]
    for test, entry in sorted(load_expected().items()):
        lines.append(f'| `{test}` | {entry["why"]} | "{entry["compat"]}" |')
    return "\n".join(lines)


def write_report() -> None:
    """Replace the table between the markers in docs/compat.md."""
    text = COMPAT.read_text(encoding="utf-8")
    if _BEGIN not in text or _END not in text:
        raise SystemExit(f"upstream_suite: {COMPAT} lacks the {_BEGIN} / {_END} markers")
    head, rest = text.split(_BEGIN, 1)
    _, tail = rest.split(_END, 1)
    COMPAT.write_text(f"{head}{_BEGIN}\n{report_table()}\n{_END}{tail}", encoding="utf-8")
    print(f"upstream_suite: wrote the table into {COMPAT}")


def check_report() -> int:
    """Fail when docs/compat.md's table is not the one the last two runs give."""
    text = COMPAT.read_text(encoding="utf-8")
    if _BEGIN not in text or _END not in text:
        raise SystemExit(f"upstream_suite: {COMPAT} lacks the {_BEGIN} / {_END} markers")
    written = text.split(_BEGIN, 1)[1].split(_END, 1)[0].strip()
    wanted = report_table().strip()
    if written == wanted:
        print(f"upstream_suite: the table in {COMPAT.name} matches both runs")
        return 0
    import difflib

    diff = difflib.unified_diff(
        written.splitlines(), wanted.splitlines(), "docs/compat.md", "these runs", lineterm=""
    )
    print("\n".join(diff))
    print(
        f"upstream_suite: the table in {COMPAT.name} is stale: run "
        "`python tools/upstream_suite.py --report` after both runs and commit it"
    )
    return 1


def run(
    lib: str,
    python: str,
    sdist: Path | None = None,
    gpu: bool = False,
    timeout: float = PYTEST_TIMEOUT,
) -> int:
    """Download (unless ``sdist`` is given), extract, run and compare; return the exit code."""
    suffix = "-gpu" if gpu else ""
    dest = extract(sdist if sdist is not None else download_sdist(python), lib, lib + suffix)
    if gpu:
        files = gpu_files(dest)
        print(f"upstream_suite: GPU-gated tests of {len(files)} files: {', '.join(files)}")
        results = run_pytest(python, lib, dest, files, gpu=True, timeout=timeout)
    else:
        results = run_pytest(python, lib, dest, timeout=timeout)
        results.update(run_scripts(python, lib, dest))
    out = WORK / f"results-{lib}{suffix}.json"
    out.write_text(json.dumps({"lib": lib, "results": results}, indent=1), encoding="utf-8")
    counts = summarise(results)
    for name, row in counts.items():
        print(f"  {name}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped")
    expected = load_expected()
    problems = compare(lib, results, expected, COMPAT.read_text(encoding="utf-8"), partial=gpu)
    if lib == "accel":
        listed = sum(1 for test in expected if results.get(test, {}).get("outcome") == "failed")
        print(f"upstream_suite: {listed} listed differences failed as expected")
    for problem in problems:
        print(f"upstream_suite: {problem}")
    print(f"upstream_suite: {'FAILED' if problems else 'OK'} ({lib}); results in {out}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", choices=LIBS, help="run the suite against this library")
    parser.add_argument("--python", default=sys.executable, help="interpreter with the library")
    parser.add_argument(
        "--sdist", type=Path, help=f"accelerate-{VERSION}.tar.gz to use instead of downloading"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="only the tests Accelerate gates on an accelerator"
    )
    parser.add_argument(
        "--timeout", type=float, default=PYTEST_TIMEOUT, help="seconds for the pytest run"
    )
    parser.add_argument("--report", action="store_true", help="write the table to compat.md")
    parser.add_argument(
        "--check-report", action="store_true", help="fail if compat.md's table is stale"
    )
    args = parser.parse_args(argv)
    if args.report:
        write_report()
        return 0
    if args.check_report:
        return check_report()
    if args.lib is None:
        parser.error("give --lib accel, --lib accelerate or --report")
    if args.sdist is not None and not args.sdist.is_file():
        parser.error(f"--sdist {args.sdist}: no such file (give accelerate-{VERSION}.tar.gz)")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, not {args.timeout}")
    # Absolute, but not resolved: a venv's python is a symlink to the base interpreter.
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    sdist = args.sdist.resolve() if args.sdist is not None else None
    return run(args.lib, python, sdist, args.gpu, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
