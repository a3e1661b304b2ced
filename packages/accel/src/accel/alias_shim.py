"""``accel alias install`` / ``remove``: the ``accelerate`` alias written into an environment.

For scripts one does not edit (``python train.py`` using transformers' ``Trainer``,
``accelerate launch ...`` from a model card), the alias must be there before the script runs.
An environment variable read at interpreter start-up would need code run by a ``.pth`` file in
every interpreter of the environment, and could not provide the ``accelerate`` command;
instead, ``accel alias install`` writes, into the environment's ``site-packages``:

- ``accelerate/__init__.py``: three lines that hand ``import accelerate`` to
  :func:`accel.alias.activate_installed_alias` (``accelerate.*`` then resolves to ``accel.*``);
- ``accelerate-<API version>+accel.<accel version>.dist-info``: the metadata pip,
  transformers and peft read (it satisfies ``accelerate>=...`` requirements, so installing peft
  or trl afterwards does not pull the real Accelerate), with accel's marker file and a
  ``RECORD`` that lets ``pip uninstall accelerate`` remove it too;
- the commands ``accelerate``, ``accelerate-launch``, ``accelerate-config``,
  ``accelerate-estimate-memory`` and ``accelerate-merge-weights``, which run accel's.

Nothing is written where the real Accelerate is installed, and a failed install leaves nothing
behind (the files are staged, then moved into place, and moved back out on error).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from accel_state.accelerate_alias import ACCELERATE_API_VERSION, ALIAS_MODULE, MARKER_FILE

from .__about__ import __version__
from .alias import AliasError, alias_distribution_version

__all__ = ["ShimPaths", "install_alias", "remove_alias", "shim_paths"]

#: Accelerate's commands and the ``accel`` subcommand each one runs.
COMMANDS: dict[str, tuple[str, ...]] = {
    "accelerate": (),
    "accelerate-config": ("config",),
    "accelerate-estimate-memory": ("estimate-memory",),
    "accelerate-launch": ("launch",),
    "accelerate-merge-weights": ("merge-weights",),
}
_SCRIPT_MARK = "# Written by `accel alias install`"
_PACKAGE_INIT = '''"""accel stands in for Accelerate in this environment.

Written by `accel alias install`; `accel alias remove` (or `pip uninstall accelerate`) removes it.
"""

import sys

import accel.alias

accel.alias.activate_installed_alias(sys.modules[__name__])
'''


@dataclass(frozen=True)
class ShimPaths:
    """Where the alias goes: ``site`` (a ``site-packages`` folder) and ``scripts`` (its ``bin``)."""

    site: Path
    scripts: Path

    @property
    def package(self) -> Path:
        """The ``accelerate`` package folder."""
        return self.site / ALIAS_MODULE

    @property
    def dist_info(self) -> Path:
        """The ``dist-info`` folder of this accel's alias."""
        return self.site / f"{ALIAS_MODULE}-{alias_distribution_version()}.dist-info"


def shim_paths(site: str | os.PathLike[str] | None = None) -> ShimPaths:
    """The running interpreter's ``site-packages`` and scripts folder, or ``site`` and its bin."""
    if site is not None:
        root = Path(site)
        return ShimPaths(root, root / "bin")
    paths = sysconfig.get_paths()
    return ShimPaths(Path(paths["purelib"]), Path(paths["scripts"]))


def _script(command: str, subcommand: tuple[str, ...]) -> str:
    arguments = "".join(f"{word!r}, " for word in subcommand)
    return (
        f"#!{sys.executable}\n"
        f"{_SCRIPT_MARK} (accel {__version__}): Accelerate's `{command}` runs accel's.\n"
        "import sys\n\n"
        "from accel_launch.cli import main\n\n"
        'if __name__ == "__main__":\n'
        f"    sys.exit(main([{arguments}*sys.argv[1:]]))\n"
    )


def _metadata() -> dict[str, str]:
    entry_points = "[console_scripts]\n" + "".join(
        f"{name} = accel_launch.cli:main\n" for name in COMMANDS
    )
    return {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {ALIAS_MODULE}\n"
            f"Version: {alias_distribution_version()}\n"
            f"Summary: accel {__version__} standing in for Accelerate {ACCELERATE_API_VERSION} "
            "(accel alias install)\n"
            f"Requires-Dist: accel=={__version__}\n"
        ),
        "INSTALLER": "accel\n",
        "top_level.txt": f"{ALIAS_MODULE}\n",
        "entry_points.txt": entry_points,
        MARKER_FILE: json.dumps(
            {"accel": __version__, "how": "accel alias install", "commands": sorted(COMMANDS)}
        )
        + "\n",
    }


def _record_row(staged: Path, final: Path, site: Path) -> list[str]:
    """A ``RECORD`` row for a staged file: its final path relative to ``site``, hash, size."""
    data = staged.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [os.path.relpath(final, site).replace(os.sep, "/"), f"sha256={digest}", str(len(data))]


def _find_ours(site: Path) -> Path | None:
    """The alias's ``dist-info`` in ``site`` (any accel version), or None."""
    for candidate in sorted(site.glob(f"{ALIAS_MODULE}-*.dist-info")):
        if (candidate / MARKER_FILE).is_file():
            return candidate
    return None


def _refuse_foreign(paths: ShimPaths) -> None:
    """Refuse to write where something that is not accel's alias already answers the names."""
    for candidate in sorted(paths.site.glob(f"{ALIAS_MODULE}-*.dist-info")):
        if not (candidate / MARKER_FILE).is_file():
            raise AliasError(
                f"the real Accelerate is installed in {paths.site} ({candidate.name}): accel "
                "cannot stand in for it there. Uninstall it (`pip uninstall accelerate`) first, "
                "or keep using Accelerate; nothing was written"
            )
    ours = _find_ours(paths.site)
    if paths.package.exists() and ours is None:
        raise AliasError(
            f"{paths.package} exists and is not accel's alias (no {MARKER_FILE} beside it): "
            "nothing was written; remove that package first"
        )
    for command in COMMANDS:
        script = paths.scripts / command
        if script.exists() and _SCRIPT_MARK not in script.read_text(errors="replace"):
            raise AliasError(
                f"{script} exists and was not written by accel: nothing was written; remove it "
                "first (a leftover of an Accelerate install?)"
            )


def _stage(paths: ShimPaths, staging: Path) -> dict[Path, Path]:
    """Write every file under ``staging``; return staged path -> final path."""
    moves: dict[Path, Path] = {}
    package = staging / "package"
    package.mkdir()
    (package / "__init__.py").write_text(_PACKAGE_INIT, encoding="utf-8")
    moves[package] = paths.package
    dist_info = staging / "dist-info"
    dist_info.mkdir()
    for name, text in _metadata().items():
        (dist_info / name).write_text(text, encoding="utf-8")
    moves[dist_info] = paths.dist_info
    for command, subcommand in COMMANDS.items():
        script = staging / f"script-{command}"
        script.write_text(_script(command, subcommand), encoding="utf-8")
        script.chmod(0o755)
        moves[script] = paths.scripts / command
    rows = [_record_row(package / "__init__.py", paths.package / "__init__.py", paths.site)]
    rows += [
        _record_row(dist_info / name, paths.dist_info / name, paths.site)
        for name in sorted(_metadata())
    ]
    rows += [
        _record_row(staging / f"script-{command}", paths.scripts / command, paths.site)
        for command in COMMANDS
    ]
    rows.append([f"{paths.dist_info.name}/RECORD", "", ""])
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    (dist_info / "RECORD").write_text(buffer.getvalue(), encoding="utf-8")
    return moves


def install_alias(site: str | os.PathLike[str] | None = None) -> ShimPaths:
    """Write the ``accelerate`` alias into an environment; return where it went.

    Args:
        site: A ``site-packages`` folder (its commands go to ``<site>/bin``); default: the
            running interpreter's, with its scripts folder.

    Raises:
        AliasError: the real Accelerate (or another ``accelerate`` package or command) is
            there; nothing was written.
        OSError: a folder cannot be written; nothing was left behind.
    """
    paths = shim_paths(site)
    _refuse_foreign(paths)
    paths.site.mkdir(parents=True, exist_ok=True)
    paths.scripts.mkdir(parents=True, exist_ok=True)
    remove_alias(site)  # an earlier alias (another accel version) is replaced as a whole
    staging = Path(tempfile.mkdtemp(prefix=".accel-alias-", dir=paths.site))
    done: list[tuple[Path, Path]] = []
    try:
        for staged, final in _stage(paths, staging).items():
            os.replace(staged, final)
            done.append((staged, final))
    except BaseException:
        for staged, final in reversed(done):
            os.replace(final, staged)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def remove_alias(site: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the alias that :func:`install_alias` wrote; return the files removed.

    Only files listed in the alias's ``RECORD`` are removed; a real Accelerate is never
    touched. Nothing installed: returns ``[]``.
    """
    paths = shim_paths(site)
    dist_info = _find_ours(paths.site)
    if dist_info is None:
        return []
    removed: list[Path] = []
    record = dist_info / "RECORD"
    rows = (
        list(csv.reader(record.read_text(encoding="utf-8").splitlines())) if record.exists() else []
    )
    for row in rows:
        if not row:
            continue
        file = Path(os.path.normpath(paths.site / row[0]))
        if file.is_file():
            file.unlink()
            removed.append(file)
    for folder in (paths.package / "__pycache__", paths.package, dist_info):
        shutil.rmtree(folder, ignore_errors=True)
    return removed
