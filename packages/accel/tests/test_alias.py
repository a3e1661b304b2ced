"""accel standing in for ``accelerate``: ``install_as_accelerate()`` and ``accel alias``.

Each check runs in a fresh interpreter (the alias changes ``sys.modules`` and ``sys.meta_path``
for the life of the process), with accel installed and no real Accelerate: that is how
transformers, peft and trl meet it. A fake "real Accelerate" (a package and a dist-info on
``PYTHONPATH``) stands in for an installed one where the refusals are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import accel
from accel.alias import AliasError
from accel.alias_shim import COMMANDS, install_alias, remove_alias, shim_paths

pytestmark = pytest.mark.skipif(
    any(p.joinpath("accelerate", "__init__.py").exists() for p in map(Path, sys.path) if p.name),
    reason="the real Accelerate is importable here",
)


def run_python(code: str, *, pythonpath: list[Path] | None = None, **env: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fails on a non-zero exit)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def fake_accelerate(site: Path, version: str = "1.15.0") -> Path:
    """A stand-in for the real Accelerate installed in ``site``: its package and its dist-info."""
    (site / "accelerate").mkdir(parents=True)
    (site / "accelerate" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"accelerate-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accelerate\nVersion: {version}\n")
    return site


# --- install_as_accelerate() ------------------------------------------------------------------


def test_the_alias_is_accel_under_accelerates_names() -> None:
    out = run_python(
        """
        import importlib, importlib.metadata, importlib.util, json
        import accel
        alias = accel.install_as_accelerate()
        import accelerate
        import accelerate.utils.modeling
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType, get_balanced_memory
        from accelerate.commands.config import default_config_file, load_config_from_file
        from accelerate.commands.launch import launch_command, launch_command_parser
        import accelerate.commands.accelerate_cli as cli
        import accel.hooks, accel.state, accel.utils, accel.utils.modeling
        print(json.dumps({
            "same_module": alias is accelerate,
            "utils": accelerate.utils is accel.utils,
            "modeling": accelerate.utils.modeling is accel.utils.modeling,
            "hook": AlignDevicesHook is accel.hooks.AlignDevicesHook,
            "state": (AcceleratorState, PartialState)
            == (accel.state.AcceleratorState, accel.state.PartialState),
            "enum": DistributedType is accel.utils.DistributedType,
            "cli": cli.__name__,
            "names_kept": accel.utils.modeling.__name__,
            "spec_kept": accel.utils.__spec__.name,
            "version": accelerate.__version__,
            "accel_version": accelerate.__accel_version__,
            "accel": accel.__version__,
            "metadata": importlib.metadata.version("accelerate"),
            "find_spec": importlib.util.find_spec("accelerate") is not None,
            "sub_spec": importlib.util.find_spec("accelerate.utils.modeling") is not None,
            "missing": importlib.util.find_spec("accelerate.not_a_module"),
            "star": sorted(set(accelerate.__all__) - set(dir(accelerate))),
            "again": accel.install_as_accelerate() is accelerate,
        }))
        """
    )
    found = json.loads(out)
    assert found == {
        "same_module": True,
        "utils": True,
        "modeling": True,
        "hook": True,
        "state": True,
        "enum": True,
        "cli": "accel.commands.accel_cli",
        "names_kept": "accel.utils.modeling",
        "spec_kept": "accel.utils",
        "version": "1.15.0",
        "accel_version": accel.__version__,
        "accel": accel.__version__,
        "metadata": f"1.15.0+accel.{accel.__version__}",
        "find_spec": True,
        "sub_spec": True,
        "missing": None,
        "star": [],
        "again": True,
    }


def test_patching_through_either_name_is_seen_through_both() -> None:
    out = run_python(
        """
        from unittest import mock
        import accel
        accel.install_as_accelerate()
        import accelerate
        import accel.utils
        original = accel.Accelerator
        with mock.patch("accelerate.Accelerator", "patched"):
            seen = (accel.Accelerator, accelerate.Accelerator)
        after = accel.Accelerator is original and accelerate.Accelerator is original
        with mock.patch("accel.utils.gather", "patched"):
            utils_seen = accelerate.utils.gather
        print(seen, after, utils_seen)
        """
    )
    assert out.split() == ["('patched',", "'patched')", "True", "patched"]


def test_errors_name_the_alias() -> None:
    out = run_python(
        """
        import accel
        accel.install_as_accelerate()
        import accelerate
        try:
            accelerate.not_a_name
        except AttributeError as error:
            print(error)
        try:
            import accelerate.not_a_module
        except ModuleNotFoundError as error:
            print(error)
        """
    )
    attribute, module = out.splitlines()
    assert "module 'accelerate' (accel" in attribute and "'not_a_name'" in attribute
    assert module == "No module named 'accelerate.not_a_module'"


def test_remove_accelerate_alias_undoes_it() -> None:
    out = run_python(
        """
        import accel, accel.alias
        accel.install_as_accelerate()
        import accelerate.utils
        accel.alias.remove_accelerate_alias()
        import importlib.util, importlib.metadata, sys
        print(importlib.util.find_spec("accelerate"), "accelerate.utils" in sys.modules)
        try:
            importlib.metadata.version("accelerate")
        except importlib.metadata.PackageNotFoundError:
            print("no metadata")
        print("accel.utils" in sys.modules)
        """
    )
    assert out.splitlines() == ["None False", "no metadata", "True"]


def test_the_alias_gives_the_launchers_variables_accelerates_names() -> None:
    out = run_python(
        """
        import os, accel
        accel.install_as_accelerate()
        print(os.environ["ACCELERATE_MIXED_PRECISION"], os.environ["ACCELERATE_USE_CPU"])
        print(os.environ["ACCELERATE_DEBUG_MODE"])  # the user's own value is kept
        """,
        ACCEL_MIXED_PRECISION="bf16",
        ACCEL_USE_CPU="true",
        ACCEL_DEBUG_MODE="false",
        ACCELERATE_DEBUG_MODE="0",
    )
    assert out.splitlines() == ["bf16 true", "0"]


@pytest.mark.torch_feature("fully_shard")
def test_the_accelerator_announces_its_engine_where_the_alias_is_active() -> None:
    code = """
        import os, accel
        {install}
        from accel import Accelerator, FullyShardedDataParallelPlugin
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
        print(os.environ.get("ACCELERATE_USE_FSDP"))
        """
    with_alias = run_python(code.format(install="accel.install_as_accelerate()"))
    without = run_python(code.format(install=""))
    assert (with_alias.split()[-1], without.split()[-1]) == ("true", "None")


def test_accel_env_reports_the_alias() -> None:
    out = run_python(
        """
        import accel
        from accel_launch.cli import environment_info
        print(environment_info()["`accelerate` alias"])
        accel.install_as_accelerate()
        print(environment_info()["`accelerate` alias"])
        """
    )
    before, after = out.splitlines()
    assert before.startswith("not installed")
    assert after == "active in this process"


def test_it_refuses_where_the_real_accelerate_is_installed(tmp_path: Path) -> None:
    site = fake_accelerate(tmp_path / "site")
    out = run_python(
        """
        import sys, accel
        from accel.alias import AliasError
        try:
            accel.install_as_accelerate()
        except AliasError as error:
            print(error)
        finders = [f for f in sys.meta_path if getattr(f, "accel_alias", False)]
        print("accelerate" in sys.modules, bool(finders))
        import accelerate
        print(accelerate.__version__)
        """,
        pythonpath=[site],
    )
    message, state, version = out.splitlines()
    assert "accelerate 1.15.0 at" in message and str(site) in message
    assert "pip uninstall accelerate" in message and "changed nothing" in message
    assert state == "False False" and version == "1.15.0"


def test_it_refuses_where_a_module_named_accelerate_is_imported() -> None:
    out = run_python(
        """
        import sys, types, accel
        sys.modules["accelerate"] = types.ModuleType("accelerate")
        from accel.alias import AliasError
        try:
            accel.install_as_accelerate()
        except AliasError as error:
            print(error)
        print(type(sys.modules["accelerate"]).__name__)
        """
    )
    message, kept = out.splitlines()
    assert "the module accelerate" in message and "(imported)" in message
    assert kept == "module"


# --- accel alias install / remove --------------------------------------------------------------


def test_installed_alias_needs_no_code_and_gives_the_commands(tmp_path: Path) -> None:
    site = tmp_path / "site"
    paths = install_alias(site)
    assert sorted(p.name for p in paths.scripts.iterdir()) == sorted(COMMANDS)
    out = run_python(
        """
        import importlib.metadata, importlib.util, json
        spec = importlib.util.find_spec("accelerate")
        import accelerate, accel, accelerate.utils
        from accel_state.accelerate_alias import alias_status
        print(json.dumps({
            "origin": spec.origin,
            "version": importlib.metadata.version("accelerate"),
            "module_version": accelerate.__version__,
            "utils": accelerate.utils is accel.utils,
            "status": alias_status().describe(),
            "record": importlib.metadata.distribution("accelerate").read_text("RECORD") != None,
        }))
        """,
        pythonpath=[site],
    )
    found = json.loads(out)
    assert found["origin"] == str(site / "accelerate" / "__init__.py")
    assert found["version"] == f"1.15.0+accel.{accel.__version__}"
    assert found["module_version"] == "1.15.0" and found["utils"] and found["record"]
    assert found["status"] == (
        f"installed in {site} (`accel alias install`); active in this process"
    )
    environ = {**os.environ, "PYTHONPATH": str(site)}
    version = subprocess.run(
        [str(paths.scripts / "accelerate"), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert version.returncode == 0 and version.stdout.startswith(f"accel {accel.__version__}")
    launch_help = subprocess.run(
        [str(paths.scripts / "accelerate-launch"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert launch_help.returncode == 0 and "--num_processes" in launch_help.stdout
    env = subprocess.run(
        [str(paths.scripts / "accelerate"), "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert f"- `accelerate` alias: installed in {site}" in env.stdout, env.stdout
    config = subprocess.run(  # transformers' docs print `accelerate config`
        [str(paths.scripts / "accelerate"), "config", "default", "--config_file", "cfg.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        cwd=tmp_path,
    )
    assert config.returncode == 0 and (tmp_path / "cfg.yaml").is_file(), config.stderr
    # python -m accelerate.commands.launch runs accel's module
    module = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert module.returncode == 0 and "--num_processes" in module.stdout, module.stderr


def test_remove_leaves_nothing_and_install_is_repeatable(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_alias(site)
    install_alias(site)  # again: replaced as a whole
    removed = remove_alias(site)
    assert len(removed) == 1 + 6 + len(COMMANDS)  # package, dist-info files, commands
    assert sorted(p.name for p in site.iterdir()) == ["bin"]
    assert list((site / "bin").iterdir()) == []
    assert remove_alias(site) == []


def test_install_refuses_beside_the_real_accelerate_and_writes_nothing(tmp_path: Path) -> None:
    site = fake_accelerate(tmp_path / "site")
    before = sorted(str(p) for p in site.rglob("*"))
    with pytest.raises(AliasError, match=r"the real Accelerate is installed in .*accelerate-1\.15"):
        install_alias(site)
    assert sorted(str(p) for p in site.rglob("*")) == before


def test_install_refuses_a_foreign_command(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "bin").mkdir(parents=True)
    (site / "bin" / "accelerate").write_text("#!/bin/sh\necho someone else's\n")
    with pytest.raises(AliasError, match="was not written by accel"):
        install_alias(site)
    assert sorted(p.name for p in site.rglob("*")) == ["accelerate", "bin"]


def test_a_failed_install_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    moves = []
    real_replace = os.replace

    def failing_replace(src: str | Path, dst: str | Path) -> None:
        moves.append(dst)
        if len(moves) == 3:  # after the package and the dist-info are in place
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        install_alias(site)
    assert sorted(p.name for p in site.rglob("*")) == ["bin"]


def test_the_command_installs_reports_and_removes(tmp_path: Path) -> None:
    from accel.commands.alias import alias_command, alias_command_parser

    site = tmp_path / "site"
    parser = alias_command_parser()
    assert alias_command(parser.parse_args(["install", "--site", str(site)])) == 0
    assert shim_paths(site).dist_info.is_dir()
    assert alias_command(parser.parse_args(["remove", "--site", str(site)])) == 0
    assert not shim_paths(site).package.exists()
    fake_accelerate(site)
    assert alias_command(parser.parse_args(["install", "--site", str(site)])) == 2
