"""Run every code block of the documentation, so that the pages cannot drift from the code.

    python tools/docs/check_examples.py                 # every page under docs/
    python tools/docs/check_examples.py docs/quicktour.md -k launch --list

Every fenced code block names its language. ``text`` blocks (output, diagrams) are not checked;
``python`` blocks of a page run in one interpreter, in document order, sharing one namespace;
``bash`` (``sh``, ``shell``) blocks run with ``bash -euo pipefail``; ``yaml``, ``toml`` and
``json`` blocks are parsed. A marker, an HTML comment on the nearest non-blank line above the
fence, changes what happens to one block:

    <!-- check: syntax, needs a GPU -->   python: compiled, then only its import statements run
                                          (in a separate fresh interpreter); bash: ``bash -n``.
                                          The reason is required.
    <!-- check: file train.py -->         the block is written to train.py in the page's folder
                                          (compiled or parsed, not run); later blocks use it.

Each page runs in a fresh temporary folder (its own HOME too), with the ``ACCEL_*`` and
``ACCELERATE_*`` variables removed, on the CPU (``CUDA_VISIBLE_DEVICES`` empty), offline for
the Hugging Face hub, with this interpreter's bin folder first on PATH (so ``python`` and
``accel`` are this venv's), under a time limit for the whole page. A page's lines
``--8<-- "PATH"`` (pymdownx.snippets, PATH relative to the repository root) are checked as part
of the page. On a failure the page, the line, the block and its output are printed and the exit
code is 1. Standard library only (plus PyYAML for yaml blocks).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = "Run every code block of the documentation (see this script's docstring)."
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
DATA = {"yaml", "yml", "toml", "json"}
TEXT = {"text"}
KNOWN = sorted(PYTHON | SHELL | DATA | TEXT)
DEFAULT_TIMEOUT = 180.0
OUTPUT_LINES = 120  # lines of a failing block's output that are printed (the last ones)

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*check\b(?P<body>.*?)-->\s*$")
SYNTAX = re.compile(r"^:\s*syntax\s*,\s*(?P<reason>\S.*?)\s*$")
FILE = re.compile(r"^:\s*file\s+(?P<name>\S+)\s*$")
SNIPPET = re.compile(r"""^\s*-{2}8<-{2}\s+["'](?P<path>[^"']+)["']\s*$""")


@dataclass(frozen=True)
class Line:
    """One line of a page after snippet inclusion, with where it comes from."""

    text: str
    source: Path
    number: int  # 1-based, in ``source``


@dataclass(frozen=True)
class Block:
    """One fenced code block and what the checker does with it."""

    source: Path  # the file that holds it (the page, or a file the page includes)
    line: int  # the opening fence's line in ``source``
    language: str
    code: str
    action: str  # "run", "syntax", "file", "parse" or "skip"
    detail: str = ""  # the reason (syntax) or the file name (file)

    @property
    def where(self) -> str:
        return f"{display(self.source)}:{self.line}"

    def padded(self) -> str:
        """The code preceded by blank lines, so that line numbers are the Markdown file's."""
        return "\n" * self.line + self.code


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Failure:
    block: Block | None
    message: str
    output: str = ""


def display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# Reading pages
# ---------------------------------------------------------------------------------------------


def read_lines(path: Path, depth: int = 0) -> list[Line]:
    """The lines of ``path``, with ``--8<-- "file"`` lines replaced by that file's lines."""
    lines: list[Line] = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = SNIPPET.match(text)
        if match and depth < 5:
            lines.extend(read_lines(ROOT / match.group("path"), depth + 1))
        else:
            lines.append(Line(text, path, number))
    return lines


def _language(info: str) -> str:
    words = info.strip().split()
    if not words:
        return ""
    first = words[0].lower()
    if first.startswith("{"):
        classes = re.findall(r"\.([\w-]+)", info)
        return classes[0].lower() if classes else ""
    return first


def _marker(lines: list[Line], fence: int) -> tuple[str, str] | str | None:
    """The marker above line index ``fence``: (action, detail), an error message, or None."""
    index = fence - 1
    while index >= 0 and not lines[index].text.strip():
        index -= 1
    if index < 0:
        return None
    match = MARKER.match(lines[index].text)
    if match is None:
        return None
    body = match.group("body")
    if syntax := SYNTAX.match(body):
        return ("syntax", syntax.group("reason"))
    if file := FILE.match(body):
        name = file.group("name")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"file marker {name!r}: give a relative path inside the page's folder"
        return ("file", name)
    return (
        f"bad marker {lines[index].text.strip()!r}: use <!-- check: syntax, REASON --> "
        "or <!-- check: file NAME -->"
    )


def _action(language: str, marker: tuple[str, str] | None) -> tuple[str, str] | str:
    """What to do with a block (action, detail), or an error message."""
    if not language:
        return "code block without a language: name one (text for output and diagrams)"
    if language in TEXT:
        return "a check marker on a text block has no effect: remove it" if marker else ("skip", "")
    if language not in PYTHON | SHELL | DATA:
        return f"language {language!r} is not checked: use one of {', '.join(KNOWN)}"
    if marker is None:
        return ("parse", "") if language in DATA else ("run", "")
    if marker[0] == "syntax" and language in DATA:
        return ("parse", "")
    return marker


def parse_page(path: Path) -> Page:
    """Find every fenced block of a page; problems with labels and markers go to ``errors``."""
    page = Page(path)
    lines = read_lines(path)
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index].text)
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end].text):
            end += 1
        body = [_dedent(line.text, indent) for line in lines[index + 1 : end]]
        start = lines[index]
        marker = _marker(lines, index)
        decided = marker if isinstance(marker, str) else _action(_language(opening["info"]), marker)
        if isinstance(decided, str):
            page.errors.append(f"{display(start.source)}:{start.number}: {decided}")
        else:
            code = "\n".join(body) + "\n"
            language = _language(opening["info"])
            block = Block(start.source, start.number, language, code, *decided)
            page.blocks.append(block)
        index = end + 1
    return page


def _dedent(text: str, indent: int) -> str:
    strip = len(text) - len(text.lstrip(" \t"))
    return text[min(strip, indent) :]


def find_pages(paths: list[Path], selectors: list[str]) -> list[Path]:
    pages: list[Path] = []
    for path in paths:
        found = sorted(path.rglob("*.md")) if path.is_dir() else [path]
        pages.extend(found)
    if selectors:
        pages = [p for p in pages if any(s in display(p) for s in selectors)]
    return list(dict.fromkeys(pages))


# ---------------------------------------------------------------------------------------------
# Static checks: compile, bash -n, parse
# ---------------------------------------------------------------------------------------------


def static_check(block: Block) -> Failure | None:
    """Compile a python block, ``bash -n`` a shell block, parse a data block."""
    try:
        if block.language in PYTHON:
            compile(block.padded(), str(block.source), "exec", dont_inherit=True)
        elif block.language in SHELL:
            result = subprocess.run(
                ["bash", "-n", "-c", block.code], capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                return Failure(block, "bash -n: syntax error", result.stdout + result.stderr)
        elif block.language in DATA:
            parse_data(block)
    except SyntaxError as error:
        return Failure(block, f"syntax error: {error.msg} (line {error.lineno})")
    except ValueError as error:
        return Failure(block, f"does not parse as {block.language}: {error}")
    return None


def parse_data(block: Block) -> None:
    """Parse a yaml, toml or json block; raise ValueError when it does not parse."""
    if block.language == "json":
        json.loads(block.code)
    elif block.language == "toml":
        tomllib.loads(block.code)
    else:
        import yaml  # type: ignore[import-untyped,unused-ignore]  # PyYAML, accel-launch's dep

        try:
            list(yaml.safe_load_all(block.code))
        except yaml.YAMLError as error:
            raise ValueError(str(error)) from error


class _ImportCollector(ast.NodeVisitor):
    """Import statements of a block, except those inside ``try`` (guarded on purpose)."""

    def __init__(self) -> None:
        self.imports: list[ast.stmt] = []

    def visit_Import(self, node: ast.Import) -> None:
        self.imports.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module != "__future__":
            self.imports.append(node)

    def visit_Try(self, node: ast.Try) -> None:
        return None

    def visit_TryStar(self, node: ast.TryStar) -> None:
        return None


def imports_only(block: Block) -> str:
    """The block's import statements, each on its own line of the Markdown file."""
    collector = _ImportCollector()
    collector.visit(ast.parse(block.padded()))
    lines = [""] * (block.line + block.code.count("\n") + 1)
    for node in collector.imports:
        lines[node.lineno - 1] = ast.unparse(node)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Running: one python interpreter per page (the driver), bash per block
# ---------------------------------------------------------------------------------------------

# Runs in the page's interpreter: reads one JSON request per line from fd argv[1], runs the code
# in __main__ (so that classes defined there pickle), its output going to the request's file,
# and answers on fd argv[2]. Its own names are deleted so that blocks see a clean namespace.
DRIVER = r"""
def _accel_docs_driver():
    import builtins, json, linecache, os, sys, traceback
    del globals()["_accel_docs_driver"]
    shared = sys.modules["__main__"].__dict__
    commands = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
    answers = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    for request in commands:
        request = json.loads(request)
        code, filename = request["code"], request["filename"]
        if request["shared"]:
            namespace = shared
        else:
            namespace = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout.flush(); sys.stderr.flush()
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        saved = os.dup(1), os.dup(2)
        os.dup2(out, 1); os.dup2(out, 2)
        answer = {"ok": True, "error": ""}
        try:
            exec(compile(code, filename, "exec", dont_inherit=True), namespace)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                answer = {"ok": False, "error": f"SystemExit({stop.code!r})"}
        except BaseException as error:
            lines = traceback.format_exception(type(error), error, error.__traceback__.tb_next)
            answer = {"ok": False, "error": "".join(lines)}
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            for fd in (*saved, out):
                os.close(fd)
        answers.write(json.dumps(answer) + "\n"); answers.flush()
_accel_docs_driver()
"""


class TimeLimit(Exception):
    """The page ran past its time limit."""


class Interpreter:
    """A python process that runs the blocks it is sent, one at a time."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path) -> None:
        command_read, self._commands = os.pipe()
        self._answers, answer_write = os.pipe()
        with log.open("ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(command_read), str(answer_write)],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                pass_fds=(command_read, answer_write),
                start_new_session=True,
            )
        os.close(command_read)
        os.close(answer_write)
        self._buffer = b""

    def run(self, code: str, filename: str, output: Path, deadline: float, shared: bool) -> str:
        """Run ``code``; return "" on success, else the error. Raises TimeLimit."""
        request = {"code": code, "filename": filename, "output": str(output), "shared": shared}
        try:
            os.write(self._commands, (json.dumps(request) + "\n").encode())
        except BrokenPipeError:
            return f"the interpreter exited with code {self.process.wait()} before the block"
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeLimit
            ready, _, _ = select.select([self._answers], [], [], remaining)
            if ready:
                chunk = os.read(self._answers, 65536)
                if not chunk:
                    code_ = self.process.wait()
                    return f"the interpreter exited with code {code_} while running the block"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer = json.loads(line)
        return "" if answer["ok"] else str(answer["error"])

    def close(self) -> None:
        os.close(self._commands)  # the driver stops at the end of its input
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.process)
        os.close(self._answers)


def kill_group(process: subprocess.Popen[Any]) -> None:
    """Kill what the process started too (its session), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def page_environment(home: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ACCEL_", "ACCELERATE_"))
    }
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        HF_HOME=str(home / ".cache" / "huggingface"),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
    )
    return env


class PageRun:
    """Run one page's blocks in a fresh folder; collect the first failure."""

    def __init__(self, page: Page, timeout: float) -> None:
        self.page = page
        self.timeout = timeout
        self.counts = {"run": 0, "syntax": 0, "file": 0, "parse": 0, "skip": 0}
        self.current: Block | None = None  # the block running, for a time-limit report
        self.output: Path | None = None  # where its output goes

    def execute(self) -> list[Failure]:
        failures = [f for b in self.page.blocks if (f := static_check(b)) is not None]
        if failures:
            return failures
        base = Path(tempfile.mkdtemp(prefix="accel-docs-"))
        try:
            (base / "work").mkdir()
            (base / "home").mkdir()
            return self._in_folder(base)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _in_folder(self, base: Path) -> list[Failure]:
        cwd, env = base / "work", page_environment(base / "home")
        deadline = time.monotonic() + self.timeout
        interpreter: Interpreter | None = None
        try:
            for number, block in enumerate(self.page.blocks):
                self.counts[block.action] += 1
                self.current, self.output = block, base / f"output-{number}.txt"
                output = self.output
                if block.action == "file":
                    target = cwd / block.detail
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(block.code, encoding="utf-8")
                elif block.action == "run" and block.language in PYTHON:
                    if interpreter is None:
                        interpreter = Interpreter(cwd, env, base / "interpreter.txt")
                    error = interpreter.run(
                        block.padded(), str(block.source), output, deadline, shared=True
                    )
                    if error:
                        return [Failure(block, error, _read(output))]
                elif block.action == "run" and block.language in SHELL:
                    if error := run_shell(block, cwd, env, output, deadline):
                        return [Failure(block, error, _read(output))]
            return self._imports(base, cwd, env, deadline)
        except TimeLimit:
            message = f"the page ran past its time limit of {self.timeout:.0f} s in this block"
            return [Failure(self.current, message, _read(self.output) if self.output else "")]
        finally:
            if interpreter is not None:
                interpreter.close()

    def _imports(
        self, base: Path, cwd: Path, env: dict[str, str], deadline: float
    ) -> list[Failure]:
        """Run the import statements of the python syntax blocks in a fresh interpreter."""
        blocks = [b for b in self.page.blocks if b.action == "syntax" and b.language in PYTHON]
        if not blocks:
            return []
        interpreter = Interpreter(cwd, env, base / "imports.txt")
        try:
            for number, block in enumerate(blocks):
                self.current, self.output = block, base / f"imports-{number}.txt"
                output = self.output
                error = interpreter.run(
                    imports_only(block), str(block.source), output, deadline, shared=False
                )
                if error:
                    message = f"an import of this block (marked syntax) fails:\n{error}"
                    return [Failure(block, message, _read(output))]
        finally:
            interpreter.close()
        return []


def run_shell(block: Block, cwd: Path, env: dict[str, str], output: Path, deadline: float) -> str:
    """Run a shell block with ``bash -euo pipefail``; return "" or the error. Raises TimeLimit."""
    with output.open("wb") as sink:
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            raise TimeLimit from None
        finally:
            kill_group(process)
    return "" if code == 0 else f"bash exited with code {code}"


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    lines = text.splitlines()
    if len(lines) > OUTPUT_LINES:
        skipped = len(lines) - OUTPUT_LINES
        lines = [f"[... {skipped} earlier lines]", *lines[-OUTPUT_LINES:]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def describe(block: Block) -> str:
    if block.action == "syntax":
        check = "bash -n" if block.language in SHELL else "compile + imports"
        return f"syntax ({check}): {block.detail}"
    if block.action == "file":
        return f"file {block.detail} (not run)"
    return {"run": "run", "parse": "parse", "skip": "not checked"}[block.action]


def format_failure(page: Page, failure: Failure) -> str:
    lines = [f"FAILED {display(page.path)}"]
    if failure.block is not None:
        block = failure.block
        lines.append(f"  at {block.where}: {block.language} block, {describe(block)}")
        for offset, text in enumerate(block.code.rstrip("\n").splitlines(), start=1):
            lines.append(f"  {block.line + offset:5d} | {text}")
    lines.append("  error: " + failure.message.rstrip().replace("\n", "\n    "))
    if failure.output.strip():
        lines.append("  output:")
        lines.extend(f"    {text}" for text in failure.output.rstrip().splitlines())
    return "\n".join(lines)


def list_pages(pages: list[Page]) -> Iterator[str]:
    for page in pages:
        yield display(page.path)
        for block in page.blocks:
            yield f"  {block.where:<40} {block.language:<7} {describe(block)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("paths", nargs="*", type=Path, help="pages or folders (default: docs/)")
    parser.add_argument(
        "-k",
        dest="select",
        action="append",
        default=[],
        metavar="TEXT",
        help="only the pages whose path contains TEXT (repeatable)",
    )
    parser.add_argument("--list", action="store_true", help="print what would be done, run nothing")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds per page (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument("-j", "--jobs", type=int, default=1, help="pages checked at once")
    args = parser.parse_args(argv)
    paths = args.paths or [ROOT / "docs"]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        parser.error(f"no such file or folder: {', '.join(missing)}")
    pages = [parse_page(path) for path in find_pages(paths, args.select)]
    if not pages:
        print("check_examples: no page selected", file=sys.stderr)
        return 1
    if args.list:
        print("\n".join(list_pages(pages)))
    errors = [error for page in pages for error in page.errors]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        print(f"check_examples: {len(errors)} code block(s) to fix", file=sys.stderr)
        return 1
    if args.list:
        return 0
    return run_pages(pages, args.timeout, max(args.jobs, 1))


def run_pages(pages: list[Page], timeout: float, jobs: int) -> int:
    def check(page: Page) -> tuple[Page, PageRun, list[Failure], float]:
        start = time.monotonic()
        run = PageRun(page, timeout)
        return page, run, run.execute(), time.monotonic() - start

    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for page, run, failures, seconds in pool.map(check, pages):
            counts = ", ".join(f"{n} {k}" for k, n in run.counts.items() if n and k != "skip")
            status = "FAILED" if failures else "ok"
            print(f"{status:6} {display(page.path)} ({counts or 'no code'}; {seconds:.1f} s)")
            sys.stdout.flush()
            failed.extend(format_failure(page, failure) for failure in failures)
    if failed:
        print("\n\n".join(["", *failed]))
        print(f"\ncheck_examples: {len(failed)} failure(s)")
        return 1
    blocks = sum(len(page.blocks) for page in pages)
    print(f"check_examples: {len(pages)} pages, {blocks} code blocks, all pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
