"""Import every module of an installed accel package, each in its own fresh interpreter.

Usage (the isolation-<dist> nox sessions run it from a temporary directory outside the repo)::

    python tools/check_imports.py accel_data \\
        --forbid accel accel_amp accel_bigmodel accel_launch \\
        --forbid-heavy deepspeed torch_xla tensorboard transformer_engine wandb

It fails (exit code 1) when:

* the package, or any module found by ``pkgutil.walk_packages``, raises on import
  (ImportError for an undeclared dependency, or any other exception) or takes longer than
  ``--timeout`` seconds;
* after importing a module, a ``--forbid`` or ``--forbid-heavy`` module is in ``sys.modules``;
* a ``--forbid`` module (a sibling outside the package's closure) is importable at all;
* the package was imported from anywhere but site-packages (for example from the checkout).

Every interpreter is started with ``-I`` (isolated mode: no PYTHONPATH, no user site, no cwd or
script directory on sys.path). ``__main__`` modules are not imported, because importing them runs
the program. Standard library only.

Where ``os.fork`` exists, a module's fresh interpreter is a child forked from a "zygote", an
isolated interpreter that has imported torch and nothing of the package (torch is a dependency
of every accel package, and its import is most of a fresh interpreter's second): the state a
new interpreter has after ``import torch``, at a tenth of the cost. ``--no-fork`` (or torch
missing or forbidden) starts a new interpreter per module instead.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs in a child: import the package, say where it came from, list its modules.
_WALK = r"""
import importlib, importlib.util, json, pkgutil, sys, sysconfig
package, forbid = sys.argv[1], sys.argv[2:]
mod = importlib.import_module(package)
errors = []
modules = [package]
if hasattr(mod, "__path__"):
    def onerror(name):
        errors.append(name)
    for info in pkgutil.walk_packages(mod.__path__, package + ".", onerror=onerror):
        modules.append(info.name)
site = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
importable = [name for name in forbid if importlib.util.find_spec(name) is not None]
print(json.dumps({
    "version": getattr(mod, "__version__", None),
    "file": getattr(mod, "__file__", None),
    "site": site,
    "modules": modules,
    "walk_errors": errors,
    "importable": importable,
}))
"""

# Both child programs: which ``forbid`` modules (or their submodules) are in ``loaded``.
_LEAKED_OF = r"""
def leaked_of(loaded, forbid):
    return sorted(f for f in forbid if f in loaded or any(m.startswith(f + ".") for m in loaded))
"""

# Runs in a child per module: import it, report which forbidden modules came along.
_IMPORT = (
    _LEAKED_OF
    + r"""
import importlib, json, sys
name, forbid = sys.argv[1], sys.argv[2:]
mod = importlib.import_module(name)
leaked = leaked_of(set(sys.modules), forbid)
print(json.dumps({"file": getattr(mod, "__file__", None), "leaked": leaked}))
"""
)


# Runs as the zygote: import torch, then for each "<module> <timeout>" line on stdin fork a child
# that imports the module and hands a JSON report back through a pipe; one JSON line out each.
_ZYGOTE = (
    _LEAKED_OF
    + r"""
import importlib, json, os, signal, sys, time, traceback
forbid = sys.argv[1:]
# tools/tests/test_check_imports.py puts its own modules first ("-I" ignores PYTHONPATH)
sys.path[:0] = [p for p in os.environ.get("CHECK_IMPORTS_TEST_PATH", "").split(os.pathsep) if p]
import torch
print(json.dumps({"ready": True, "preloaded": leaked_of(set(sys.modules), forbid)}), flush=True)
def child(name, write):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the zygote's stdin carries the next names
    os.dup2(2, 1)  # what the module prints goes to stderr, not into the reports
    try:
        mod = importlib.import_module(name)
        report = {"ok": True, "file": getattr(mod, "__file__", None),
                  "leaked": leaked_of(set(sys.modules), forbid)}
    except BaseException:
        report = {"ok": False, "error": traceback.format_exc()[-4000:]}
    os.write(write, json.dumps(report).encode())
    os._exit(0)
for line in sys.stdin:
    name, timeout = line.split()
    read, write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        child(name, write)
    os.close(write)
    status = None
    while status is None:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = code
        elif time.monotonic() - start > float(timeout):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.005)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    seconds = time.monotonic() - start
    if status == "timeout":
        report = {"ok": False, "error": f"timed out after {float(timeout):.0f}s"}
    elif not data:
        report = {"ok": False, "error": f"the importing process ended with status {status}"}
    else:
        report = json.loads(data)
    print(json.dumps({"module": name, "seconds": seconds, **report}), flush=True)
"""
)


@dataclass
class Outcome:
    """What one child interpreter reported."""

    module: str
    ok: bool
    seconds: float
    file: str | None = None
    leaked: tuple[str, ...] = ()
    error: str = ""


def _child(code: str, args: list[str], timeout: float) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            loaded = json.loads(line)
            if isinstance(loaded, dict):
                return loaded
    raise ValueError("no JSON report on stdout")


def import_one(module: str, forbid: list[str], timeout: float) -> Outcome:
    """Import ``module`` in a fresh interpreter and report what it loaded."""
    start = time.monotonic()
    try:
        code, out, err = _child(_IMPORT, [module, *forbid], timeout)
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - start
        return Outcome(module, False, seconds, error=f"timed out after {timeout:.0f}s")
    seconds = time.monotonic() - start
    if code != 0:
        tail = "\n".join(err.strip().splitlines()[-15:])
        return Outcome(module, False, seconds, error=f"exit code {code}\n{tail}")
    report = _last_json(out)
    file = report.get("file")
    leaked = report.get("leaked") or []
    return Outcome(
        module,
        True,
        seconds,
        file=str(file) if file else None,
        leaked=tuple(str(m) for m in leaked),
    )


class Zygote:
    """An isolated interpreter that has imported torch and forks a child per module."""

    def __init__(self, forbid: list[str], timeout: float) -> None:
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _ZYGOTE, *forbid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        hello = self._line()
        if not hello.get("ready"):
            raise RuntimeError(f"the zygote did not start: {self._error()}")
        self.preloaded = [str(name) for name in hello.get("preloaded") or []]

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            return {}
        loaded = json.loads(line)
        return loaded if isinstance(loaded, dict) else {}

    def _error(self) -> str:
        self.stderr.seek(0)
        return "\n".join(self.stderr.read().decode(errors="replace").strip().splitlines()[-15:])

    def import_one(self, module: str) -> Outcome:
        """Import ``module`` in a child forked from the zygote."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{module} {self.timeout}\n")
            self.proc.stdin.flush()
            report = self._line()
        except (BrokenPipeError, ValueError):
            report = {}
        if report.get("module") != module:
            return Outcome(module, False, 0.0, error=f"the zygote died: {self._error()}")
        seconds = float(report.get("seconds") or 0.0)
        if not report.get("ok"):
            tail = "\n".join(str(report.get("error", "")).strip().splitlines()[-15:])
            return Outcome(module, False, seconds, error=tail)
        file = report.get("file")
        return Outcome(
            module,
            True,
            seconds,
            file=str(file) if file else None,
            leaked=tuple(str(m) for m in report.get("leaked") or []),
        )

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def import_all_forked(
    modules: list[str], forbid: list[str], timeout: float, jobs: int
) -> list[Outcome] | None:
    """Import each module in a child of one of ``jobs`` zygotes, in ``modules``' order.

    Returns ``None`` (use fresh interpreters) where fork is missing, or torch is forbidden,
    missing or brings a forbidden module along.
    """
    if not hasattr(os, "fork") or "torch" in forbid:
        return None
    zygotes: list[Zygote] = []
    try:
        for _ in range(max(1, min(jobs, len(modules)))):
            zygotes.append(Zygote(forbid, timeout))
            if zygotes[-1].preloaded:
                raise RuntimeError("torch's import loads a forbidden module")
    except (RuntimeError, ValueError):
        for zygote in zygotes:
            zygote.close()
        return None
    todo: queue.Queue[tuple[int, str]] = queue.Queue()
    for item in enumerate(modules):
        todo.put(item)
    outcomes: dict[int, Outcome] = {}

    def drain(zygote: Zygote) -> None:
        while True:
            try:
                index, module = todo.get_nowait()
            except queue.Empty:
                return
            outcomes[index] = zygote.import_one(module)

    try:
        threads = [threading.Thread(target=drain, args=(z,)) for z in zygotes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for zygote in zygotes:
            zygote.close()
    return [outcomes[index] for index in range(len(modules))]


def _inside(path: str, folders: list[str]) -> bool:
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(Path(folder).resolve()) for folder in folders)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Import every module of an installed package.")
    parser.add_argument("package", help="import name, e.g. accel_state")
    parser.add_argument("--forbid", nargs="*", default=[], help="sibling import names")
    parser.add_argument("--forbid-heavy", nargs="*", default=[], help="heavy optional modules")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per interpreter")
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="interpreters at a time (default: CPU count, at most 4)",
    )
    parser.add_argument(
        "--no-fork",
        action="store_true",
        help="start a new interpreter per module instead of forking from one that has torch",
    )
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    package: str = args.package
    forbid_all = sorted(set(args.forbid) | set(args.forbid_heavy))
    source_tree = str(args.repo_root.resolve() / "packages")
    problems: list[str] = []

    start = time.monotonic()
    try:
        code, out, err = _child(_WALK, [package, *args.forbid], args.timeout)
    except subprocess.TimeoutExpired:
        print(f"check_imports: importing {package} timed out after {args.timeout:.0f}s")
        return 1
    if code != 0:
        print(f"check_imports: `import {package}` failed (exit code {code}):\n{err.rstrip()}")
        return 1
    walk = _last_json(out)
    version, file = walk.get("version"), walk.get("file")
    site = [str(s) for s in walk.get("site") or []]
    modules = [str(m) for m in walk.get("modules") or []]
    print(f"check_imports: {package}.__version__ = {version!r} from {file}")
    if version is None:
        problems.append(f"{package} has no __version__ attribute")
    if not file:
        problems.append(
            f"{package} has no __file__: it is a namespace package (no __init__.py in the "
            "wheel), not a regular package"
        )
    elif not _inside(str(file), site):
        problems.append(
            f"{package} was imported from {file}, not from site-packages ({', '.join(site)}); "
            "run this from a directory outside the checkout, against an installed wheel"
        )
    elif _inside(str(file), [source_tree]):
        problems.append(f"{package} was imported from the source tree ({file}), not a wheel")
    for name in walk.get("walk_errors") or []:
        problems.append(f"pkgutil.walk_packages could not import {name}")
    for name in walk.get("importable") or []:
        problems.append(
            f"{name} is importable, but it is outside {package}'s dependency closure: this "
            "environment must contain only the package and its allowed dependencies"
        )

    skipped = [m for m in modules if m.rsplit(".", 1)[-1] == "__main__"]
    to_import = [m for m in modules if m not in skipped]
    outcomes = (
        None if args.no_fork else import_all_forked(to_import, forbid_all, args.timeout, args.jobs)
    )
    forked = outcomes is not None
    if outcomes is None:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            outcomes = list(pool.map(lambda m: import_one(m, forbid_all, args.timeout), to_import))
    for outcome in outcomes:
        if not outcome.ok:
            problems.append(f"import {outcome.module} failed: {outcome.error}")
            continue
        if outcome.leaked:
            problems.append(
                f"import {outcome.module} also imported {', '.join(outcome.leaked)}; "
                "import these lazily, inside the function that needs them"
            )
        if outcome.file and not _inside(outcome.file, site):
            problems.append(f"{outcome.module} came from {outcome.file}, not site-packages")

    elapsed = time.monotonic() - start
    slowest = max(outcomes, key=lambda o: o.seconds, default=None)
    for problem in problems:
        print(f"check_imports: FAIL: {problem}")
    note = f"; skipped {', '.join(skipped)}" if skipped else ""
    slow = f"; slowest {slowest.module} {slowest.seconds:.1f}s" if slowest else ""
    status = "FAILED" if problems else "OK"
    print(
        f"check_imports: {status}: {len(outcomes)} module(s) of {package} imported, each in a "
        f"fresh interpreter{' forked after import torch' if forked else ''} "
        f"({args.jobs} at a time) in {elapsed:.1f}s{slow}{note}; "
        f"forbidden: {', '.join(forbid_all) or 'none'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
