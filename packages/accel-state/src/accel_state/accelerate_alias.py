"""Whether ``accelerate`` is accel here: the alias's markers and its status, for every package.

transformers, peft and trl import ``accelerate`` by name. ``accel`` can stand in for it (the
PyMySQL ``install_as_MySQLdb`` precedent), in two ways that ``accel`` implements:
``accel.install_as_accelerate()`` in a running interpreter, and ``accel alias install``, which
writes a small ``accelerate`` package and its ``dist-info`` into an environment. Both mark what
they make with :data:`MARKER_FILE` (a ``dist-info`` file, real or in memory), so that any
package can tell accel's alias from the real Accelerate without importing either:
``accel env`` reports it, ``accel launch`` hands the processes Accelerate's variable names
(transformers reads them) where it is installed, and the alias refuses to install over a real
Accelerate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Mapping
from importlib import metadata

from .environment import CONTRACT, accelerate_name

__all__ = [
    "ACCELERATE_API_VERSION",
    "ALIAS_MODULE",
    "MARKER_FILE",
    "AliasStatus",
    "alias_distributions",
    "alias_status",
    "accelerate_spellings",
]

#: The module name the alias answers to.
ALIAS_MODULE = "accelerate"
#: The Accelerate release whose public API accel implements: ``accelerate.__version__`` under
#: the alias, and the version its distribution metadata reports.
ACCELERATE_API_VERSION = "1.15.0"
#: A file in the alias's ``dist-info`` (JSON: who wrote it, accel's version), absent from
#: Accelerate's own.
MARKER_FILE = "accel_alias.json"


@dataclasses.dataclass(frozen=True)
class AliasStatus:
    """What ``accelerate`` is in this interpreter and its environment.

    Attributes:
        in_process: ``import accelerate`` gives accel here (the alias is imported or its
            importer is installed in this interpreter).
        installed: The folder where ``accel alias install`` wrote the ``accelerate`` package,
            or None.
        foreign: The real Accelerate found here (``"accelerate 1.15.0 at /path"``), or None.
    """

    in_process: bool
    installed: str | None
    foreign: str | None

    @property
    def active(self) -> bool:
        """Whether ``import accelerate`` gives accel, here or in processes started from here."""
        return self.in_process or self.installed is not None

    def describe(self) -> str:
        """One line for ``accel env``."""
        if self.foreign is not None:
            return f"not active: the real Accelerate is installed ({self.foreign})"
        parts = []
        if self.installed is not None:
            parts.append(f"installed in {self.installed} (`accel alias install`)")
        if self.in_process:
            parts.append("active in this process")
        if not parts:
            return "not installed (`accel alias install`, or accel.install_as_accelerate())"
        return "; ".join(parts)


def _is_alias_module(module: object) -> bool:
    return getattr(module, "__accel_version__", None) is not None


def _finder_installed() -> bool:
    return any(getattr(finder, "accel_alias", False) for finder in sys.meta_path)


def _where(dist: metadata.Distribution) -> str:
    try:
        return str(dist.locate_file(""))
    except (NotImplementedError, TypeError):  # a distribution without files (in memory)
        return "memory"


def alias_distributions() -> tuple[str | None, str | None]:
    """``(where the alias's package is installed, the real Accelerate)`` among distributions.

    Each is None when absent; the real Accelerate is described as ``accelerate <version> at
    <folder>``. Reads the distributions' metadata only: nothing is imported.
    """
    installed = foreign = None
    for dist in metadata.distributions(name=ALIAS_MODULE):
        if dist.read_text(MARKER_FILE) is not None:
            where = _where(dist)
            if where != "memory" and installed is None:
                installed = where
        elif foreign is None:
            foreign = f"accelerate {dist.version} at {_where(dist)}"
    return installed, foreign


def _module_elsewhere(installed: str | None) -> str | None:
    """An importable ``accelerate`` that no distribution declares (a source checkout)."""
    module = sys.modules.get(ALIAS_MODULE)
    if module is not None:
        if _is_alias_module(module):
            return None
        return f"the module accelerate at {getattr(module, '__file__', None) or '?'} (imported)"
    if _finder_installed():
        return None
    try:
        spec = importlib.util.find_spec(ALIAS_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    if installed is not None and os.path.dirname(os.path.dirname(spec.origin)) == installed:
        return None
    return f"the module accelerate at {spec.origin}"


def alias_status() -> AliasStatus:
    """Read what ``accelerate`` is here, without importing it."""
    installed, foreign = alias_distributions()
    if foreign is None:
        foreign = _module_elsewhere(installed)
    module = sys.modules.get(ALIAS_MODULE)
    in_process = (module is not None and _is_alias_module(module)) or _finder_installed()
    return AliasStatus(
        in_process=in_process and foreign is None, installed=installed, foreign=foreign
    )


def accelerate_spellings(environ: Mapping[str, str]) -> dict[str, str]:
    """Accelerate's spelling of every ``ACCEL_*`` variable of ``environ``, with its value.

    transformers reads Accelerate's names directly (``ACCELERATE_MIXED_PRECISION``,
    ``ACCELERATE_USE_CPU``, ``ACCELERATE_USE_FSDP``, ...) to decide how to load and wrap a model;
    where the alias stands in for Accelerate, accel's launcher and the alias itself write them
    from these, so transformers takes the path it takes under Accelerate.
    """
    spellings: dict[str, str] = {}
    for name in CONTRACT:
        theirs = accelerate_name(name)
        value = environ.get(name)
        if theirs is not None and value is not None:
            spellings[theirs] = value
    return spellings
