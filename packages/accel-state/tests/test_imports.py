"""Availability probes that import nothing, a light ``import accel_state``, version checks."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from accel_state import compare_versions, imports, is_torch_version

#: Fake optional packages: importing any of them fails loudly, yet they look installed.
FAKE_PACKAGES = {
    "deepspeed": "deepspeed",
    "torch_xla": "torch_xla",
    "tensorboard": None,
    "wandb": None,
}

#: Installed (or faked) libraries that ``import accel_state`` and the probes must not import.
MUST_NOT_IMPORT = ["psutil", "safetensors", "yaml", "rich", *FAKE_PACKAGES]

CHILD = textwrap.dedent(
    """
    import json, sys
    import accel_state
    after_import = sorted(m for m in {names} if m in sys.modules)
    from accel_state import imports
    probes = {{
        name: getattr(imports, name)()
        for name in imports.__all__
        if name.startswith("is_") and name != "is_torch_version"
    }}
    after_probes = sorted(m for m in {names} if m in sys.modules)
    print(json.dumps({{"import": after_import, "probes": probes, "after": after_probes}}))
    """
)


def _fake_installs(root: Path) -> None:
    for module, distribution in FAKE_PACKAGES.items():
        package = root / module
        package.mkdir()
        (package / "__init__.py").write_text(
            f"raise RuntimeError('{module} must not be imported by accel_state')\n"
        )
        if distribution is not None:
            info = root / f"{distribution}-0.0.1.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.1\n"
            )


@pytest.fixture(scope="module")
def child_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("fake_site")
    _fake_installs(root)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("ACCEL_DISABLE_RICH", None)
    result = subprocess.run(
        [sys.executable, "-c", CHILD.format(names=repr(MUST_NOT_IMPORT))],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_import_accel_state_imports_no_optional_library(child_report: dict[str, object]) -> None:
    assert child_report["import"] == []


def test_probes_import_nothing(child_report: dict[str, object]) -> None:
    assert child_report["after"] == []


def test_probes_return_bools_and_see_installed_packages(child_report: dict[str, object]) -> None:
    probes = child_report["probes"]
    assert isinstance(probes, dict) and probes
    assert all(isinstance(value, bool) for value in probes.values()), probes
    # Found without being imported: the fakes raise on import.
    assert probes["is_deepspeed_available"] is True
    assert probes["is_torch_xla_available"] is True
    assert probes["is_tensorboard_available"] is True
    assert probes["is_wandb_available"] is True
    # Really installed in the test environment.
    assert probes["is_safetensors_available"] is True
    assert probes["is_numpy_available"] is True


def test_probes_in_process_return_bools() -> None:
    for name in imports.__all__:
        if name.startswith("is_") and name != "is_torch_version":
            assert isinstance(getattr(imports, name)(), bool), name


def test_missing_package_and_distribution() -> None:
    assert imports.is_package_available("accel_state_no_such_module_xyz") is False
    # The module exists but the named distribution does not.
    assert imports.is_package_available("json", "accel-state-no-such-distribution") is False
    assert imports.is_package_available("torch", "torch") is True


def test_rich_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    if not imports.is_package_available("rich"):
        pytest.skip("rich is not installed")
    monkeypatch.delenv("ACCEL_DISABLE_RICH", raising=False)
    assert imports.is_rich_available() is True
    monkeypatch.setenv("ACCEL_DISABLE_RICH", "1")
    assert imports.is_rich_available() is False


def test_get_package_version() -> None:
    assert imports.get_package_version("torch") == importlib.metadata.version("torch")
    assert imports.get_package_version("accel-state-no-such-distribution") is None


@pytest.mark.parametrize(
    ("current", "operation", "required", "expected"),
    [
        ("1.2.3", ">=", "1.2", True),
        ("1.2.3", ">", "1.2.3", False),
        ("1.2.3", "==", "1.2.3.0", True),
        ("1.2.3", "!=", "1.2.3", False),
        ("2.0.0rc1", "<", "2.0.0", True),
        ("1.10", ">", "1.9", True),
        ("0.9", "<=", "0.10", True),
    ],
)
def test_compare_versions_golden(
    current: str, operation: str, required: str, expected: bool
) -> None:
    assert compare_versions(current, operation, required) is expected
    assert compare_versions(Version(current), operation, required) is expected


def test_compare_versions_reads_an_installed_library() -> None:
    installed = Version(importlib.metadata.version("torch"))
    assert compare_versions("torch", "==", str(installed)) is True
    assert compare_versions("torch", ">", "1.0") is True
    assert compare_versions("torch", "<", "1.0") is False


def test_compare_versions_unknown_library() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        compare_versions("accel-state-no-such-distribution", ">=", "1.0")


@pytest.mark.parametrize("operation", ["=>", "~=", "", "eq"])
def test_compare_versions_bad_operation_lists_the_operators(operation: str) -> None:
    with pytest.raises(ValueError, match="is not supported") as info:
        compare_versions("1.0", operation, "1.0")
    assert repr(operation) in str(info.value)
    for allowed in (">", ">=", "==", "!=", "<=", "<"):
        assert allowed in str(info.value)


def test_is_torch_version() -> None:
    base = Version(torch.__version__).base_version  # "2.13.0" for "2.13.0+cpu"
    assert is_torch_version("==", base) is True
    assert is_torch_version(">=", "2.3") is True
    assert is_torch_version("<", "2.0") is False
    assert is_torch_version("<", "99.0") is True
    with pytest.raises(ValueError, match="is not supported"):
        is_torch_version("=>", "2.0")
