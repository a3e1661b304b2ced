"""Tests for tools/check_deps.py: each builds a small fake repository in tmp_path."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "check_deps.py"

POLICY = """
[packages.accel-state]
import = "accel_state"
internal = []
third_party = ["torch", "psutil"]
optional = ["safetensors"]

[packages.accel-data]
import = "accel_data"
internal = ["accel-state"]
third_party = ["torch"]

[packages.accel-amp]
import = "accel_amp"
internal = ["accel-state"]
third_party = ["torch"]

[packages.accel]
import = "accel"
meta = true
internal = ["accel-state", "accel-data", "accel-amp"]
third_party = ["torch"]
"""

ROOT_PYPROJECT = """
[tool.ruff.lint.flake8-tidy-imports.banned-api]
"os.getenv".msg = "use os.environ"
"""


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_deps_under_test", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


check_deps = _load_checker()
IMPORTS = {
    "accel-state": "accel_state",
    "accel-data": "accel_data",
    "accel-amp": "accel_amp",
    "accel": "accel",
}
ALLOWED = {
    "accel-state": set(),
    "accel-data": {"accel-state"},
    "accel-amp": {"accel-state"},
    "accel": {"accel-state", "accel-data", "accel-amp"},
}


def make_package(
    root: Path,
    dist: str,
    *,
    version: str = "0.1.0",
    deps: list[str] | None = None,
    source: str = '"""A module."""\n',
    banned: set[str] | None = None,
    changelog: str = "# Changelog\n\n## Unreleased\n\n- Start.\n",
) -> Path:
    """Write a complete, valid package folder; arguments bend one aspect of it."""
    name = IMPORTS[dist]
    pkg = root / "packages" / dist
    src = pkg / "src" / name
    src.mkdir(parents=True)
    (src / "__init__.py").write_text(source)
    (src / "__about__.py").write_text(f'__version__ = "{version}"\n')
    (src / "py.typed").write_text("")
    (pkg / "README.md").write_text(f"# {dist}\n")
    (pkg / "CHANGELOG.md").write_text(changelog)
    if banned is None:
        banned = {IMPORTS[d] for d in IMPORTS if d != dist and d not in ALLOWED[dist]} | {"accel"}
    banned_lines = "\n".join(f'"{b}".msg = "forbidden"' for b in sorted(banned | {"os.getenv"}))
    dep_lines = ", ".join(f'"{d}"' for d in (deps if deps is not None else ["torch>=2.3"]))
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [project]
            name = "{dist}"
            dynamic = ["version"]
            dependencies = [{dep_lines}]

            [tool.hatch.version]
            path = "src/{name}/__about__.py"

            [tool.ruff]
            extend = "../../pyproject.toml"

            [tool.ruff.lint.flake8-tidy-imports.banned-api]
            """
        )
        + banned_lines
        + "\n"
    )
    return pkg


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "packages.toml").write_text(POLICY)
    (tmp_path / "pyproject.toml").write_text(ROOT_PYPROJECT)
    make_package(tmp_path, "accel-state", version="0.1.3")
    return tmp_path


def run(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = check_deps.main(["--root", str(root)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_valid_tree_passes(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "torch>=2.3"])
    code, out = run(repo, capsys)
    assert code == 0, out
    assert "OK" in out
    assert "no folder yet for accel, accel-amp" in out


def test_meta_package_must_depend_on_every_existing_sibling(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "torch>=2.3"])
    # accel-amp has no folder: the meta package need not (and must not yet) depend on it.
    make_package(repo, "accel", deps=["accel-state>=0.1,<0.2", "torch>=2.3"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "[accel] the meta package must depend on every other package" in out
    assert "lacks accel-data." in out

    shutil.rmtree(repo / "packages" / "accel")
    make_package(
        repo, "accel", deps=["accel-state>=0.1,<0.2", "accel-data>=0.1,<0.2", "torch>=2.3"]
    )
    code, out = run(repo, capsys)
    assert code == 0, out


def test_forbidden_edge_fails(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-amp", deps=["accel-state>=0.1,<0.2"])
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "accel-amp>=0.1,<0.2"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "[accel-data]" in out
    assert "dependency on 'accel-amp'" in out
    assert "not allowed" in out


def test_equal_pin_fails(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state==0.1.3"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "[accel-data]" in out
    assert "'accel-state==0.1.3' pins accel-state with '=='" in out
    assert "accel-state>=0.1,<0.2" in out  # the suggested fix


def test_range_excluding_in_repo_version_fails(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.2,<0.3"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "[accel-data]" in out
    assert "'accel-state>=0.2,<0.3' does not admit accel-state's in-repo version 0.1.3" in out


def test_missing_cap_fails(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "lacks a cap" in out


def test_function_level_import_of_forbidden_sibling_fails(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_package(repo, "accel-amp", deps=["accel-state>=0.1,<0.2"])
    source = '"""Mod."""\n\n\ndef f() -> None:\n    from accel_amp.scaler import x  # noqa\n'
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2"], source=source)
    code, out = run(repo, capsys)
    assert code == 1
    assert "packages/accel-data/src/accel_data/__init__.py:5 imports accel_amp.scaler" in out


def test_undeclared_allowed_import_fails(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["torch"], source="import accel_state\n")
    code, out = run(repo, capsys)
    assert code == 1
    assert "does not declare accel-state" in out


def test_third_party_not_in_policy_fails(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "pyyaml>=6"])
    code, out = run(repo, capsys)
    assert code == 1
    assert "'pyyaml>=6' is not allowed for accel-data" in out


def test_banned_api_table_must_match_policy(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2"], banned={"accel_state"})
    code, out = run(repo, capsys)
    assert code == 1
    assert "does not ban the forbidden siblings accel, accel_amp" in out
    assert "bans accel_state, which accel-data is allowed to import" in out


def test_changelog_needs_unreleased_heading(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2"], changelog="# Changelog\n")
    code, out = run(repo, capsys)
    assert code == 1
    assert "no '## Unreleased' heading" in out


@pytest.mark.parametrize(
    ("op", "bound", "version", "expected"),
    [
        (">=", "0.1", "0.1.0", True),
        ("<", "0.2", "0.2.0.dev0", False),
        ("<", "0.2", "0.1.9", True),
        ("~=", "0.1.2", "0.1.9", True),
        ("~=", "0.1.2", "0.2.0", False),
        ("!=", "0.1.*", "0.1.5", False),
        (">=", "1.0rc1", "1.0", True),
    ],
)
def test_spec_admits(op: str, bound: str, version: str, expected: bool) -> None:
    assert check_deps.spec_admits(op, bound, version) is expected


def test_cli_runs_as_a_script(repo: Path) -> None:
    make_package(repo, "accel-data", deps=["accel-state==0.1.3"])
    proc = subprocess.run(
        [sys.executable, str(CHECKER), "--root", str(repo)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "pins accel-state with '=='" in proc.stderr


def test_declared_torch_floor_must_be_the_tested_one(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    constraints = repo / "tools" / "constraints"
    constraints.mkdir()
    (constraints / "floor.txt").write_text("# the floor session's torch\ntorch==2.3.0\n")
    support = repo / "packages" / "accel-state" / "src" / "accel_state" / "torch_support.py"
    support.write_text('TORCH_FLOOR = "2.3"\n')
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "torch>=2.3"])
    code, out = run(repo, capsys)
    assert code == 0, out  # 2.3 and 2.3.0 are the same release

    (constraints / "floor.txt").write_text("torch==2.5.0\n")
    code, out = run(repo, capsys)
    assert code == 1
    assert "[accel-data] packages/accel-data/pyproject.toml [project.dependencies] declares" in out
    assert "Fix: declare exactly 'torch>=2.5.0'" in out
    assert "TORCH_FLOOR is '2.3', but the floor session tests torch 2.5.0" in out

    shutil.rmtree(repo / "packages" / "accel-data")
    make_package(repo, "accel-data", deps=["accel-state>=0.1,<0.2", "torch>=2.5,<3"])
    support.write_text('TORCH_FLOOR = "2.5"\n')
    code, out = run(repo, capsys)
    assert code == 1 and "declares ['torch>=2.5,<3']" in out  # a cap is not the floor
    assert "[accel-state]" in out  # still torch>=2.3
