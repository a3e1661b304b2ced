"""accel standing in for the ``accelerate`` module, for libraries that import it by name.

transformers, peft, trl and diffusers import ``accelerate`` and check its version. After
:func:`install_as_accelerate` (PyMySQL's ``install_as_MySQLdb`` is the precedent), in this
interpreter:

- ``import accelerate`` gives a module whose every name is read from, and written to,
  :mod:`accel` (so ``isinstance`` and ``unittest.mock.patch("accelerate.X")`` agree with accel),
  except ``__version__``, which is the Accelerate API version accel implements
  (:data:`~accel_state.accelerate_alias.ACCELERATE_API_VERSION`); ``__accel_version__`` is
  accel's own.
- ``import accelerate.<sub>`` gives the module ``accel.<sub>`` itself (``accelerate.utils`` *is*
  ``accel.utils``), for every submodule accel has.
- ``importlib.util.find_spec("accelerate")`` finds it and ``importlib.metadata.version
  ("accelerate")`` reports the API version (an in-memory distribution), which is how
  transformers and peft decide that Accelerate is installed.
- Accelerate's environment variables mirror accel's (``ACCELERATE_MIXED_PRECISION`` for
  ``ACCEL_MIXED_PRECISION``, ...), since transformers reads them directly.

``accel alias install`` (:mod:`accel.alias_shim`) writes a small ``accelerate`` package into an
environment that calls the same code at ``import accelerate``, for scripts one does not edit.
Both refuse where the real Accelerate is installed or already imported, and change nothing then.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from accel_state.accelerate_alias import (
    ACCELERATE_API_VERSION,
    ALIAS_MODULE,
    MARKER_FILE,
    accelerate_spellings,
    alias_distributions,
    alias_status,
)

from .__about__ import __version__

__all__ = [
    "AliasError",
    "announce_engine",
    "install_as_accelerate",
    "is_alias_active",
    "remove_accelerate_alias",
]

_PREFIX = ALIAS_MODULE + "."
#: Accelerate's module names that accel spells differently.
_RENAMED = {"accelerate.commands.accelerate_cli": "accel.commands.accel_cli"}
#: Attributes the ``accelerate`` module keeps for itself; every other one is accel's.
_OWN = frozenset(
    {
        "__name__",
        "__qualname__",
        "__spec__",
        "__loader__",
        "__package__",
        "__path__",
        "__file__",
        "__cached__",
        "__doc__",
        "__version__",
        "__accel_version__",
    }
)


class AliasError(RuntimeError):
    """accel cannot stand in for ``accelerate`` here (the real Accelerate is present)."""


def accel_module_name(name: str) -> str:
    """The accel module that ``accelerate``'s module ``name`` resolves to."""
    if name in _RENAMED:
        return _RENAMED[name]
    return "accel" + name[len(ALIAS_MODULE) :]


class AccelerateModule(types.ModuleType):
    """The ``accelerate`` module under the alias: a window onto :mod:`accel`.

    Reads, writes and deletions of every attribute but the module's own bookkeeping
    (:data:`_OWN`) go to ``accel``, so a patch through either name is seen through both.
    """

    def __getattr__(self, name: str) -> Any:
        import accel

        try:
            return getattr(accel, name)
        except AttributeError:
            raise AttributeError(
                f"module 'accelerate' (accel {__version__}, standing in for Accelerate "
                f"{ACCELERATE_API_VERSION}) has no attribute {name!r}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            super().__setattr__(name, value)
        else:
            import accel

            setattr(accel, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN:
            super().__delattr__(name)
        else:
            import accel

            delattr(accel, name)

    def __dir__(self) -> Iterable[str]:
        import accel

        return sorted(set(dir(accel)) | set(self.__dict__))


def _new_alias_module(spec: importlib.machinery.ModuleSpec | None) -> AccelerateModule:
    import accel

    module = AccelerateModule(ALIAS_MODULE, accel.__doc__)
    own = module.__dict__  # the module's own slots, written past __setattr__
    own["__version__"] = ACCELERATE_API_VERSION
    own["__accel_version__"] = __version__
    own["__file__"] = accel.__file__
    own["__path__"] = []  # every submodule comes from _AliasFinder, never from a folder
    own["__package__"] = ALIAS_MODULE
    own["__spec__"] = spec
    own["__loader__"] = spec.loader if spec is not None else None
    return module


class _TopLoader(importlib.abc.Loader):
    """Loads ``accelerate`` itself (after ``del sys.modules["accelerate"]``, say)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _new_alias_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _SubmoduleLoader(importlib.abc.Loader):
    """Loads ``accelerate.<sub>`` as the already imported ``accel.<sub>`` (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias's spec on accel's module: give it its own back.
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The code of the accel module (``python -m accelerate.commands.launch`` runs it)."""
        spec = importlib.util.find_spec(self.target)
        loader = getattr(spec, "loader", None)
        get_code = getattr(loader, "get_code", None)
        return None if get_code is None else get_code(self.target)

    def is_package(self, fullname: str) -> bool:
        spec = importlib.util.find_spec(self.target)
        return spec is not None and spec.submodule_search_locations is not None


class _AliasDistribution(metadata.Distribution):
    """The ``accelerate`` distribution's metadata, in memory (no file is written)."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {ALIAS_MODULE}\n"
                f"Version: {alias_distribution_version()}\n"
                f"Summary: accel {__version__} standing in for Accelerate "
                f"{ACCELERATE_API_VERSION} (accel.install_as_accelerate())\n"
            )
        if filename == "top_level.txt":
            return f"{ALIAS_MODULE}\n"
        if filename == MARKER_FILE:
            return json.dumps({"accel": __version__, "how": "install_as_accelerate()"})
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        raise NotImplementedError("the alias's metadata lives in memory; it has no files")


def alias_distribution_version() -> str:
    """The version the alias's distribution reports: the API version, accel's as a local label.

    ``1.15.0+accel.0.1.0`` satisfies every ``accelerate>=...`` requirement that 1.15.0 does
    (pip, transformers' and peft's checks), and ``pip list`` shows whose it is.
    """
    return f"{ACCELERATE_API_VERSION}+accel.{__version__}"


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``accelerate`` and ``accelerate.*`` (and, in memory, its distribution)."""

    accel_alias = True  # what accel_state.accelerate_alias looks for on sys.meta_path

    def __init__(self, *, metadata: bool) -> None:
        self.metadata = metadata

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == ALIAS_MODULE:
            return importlib.machinery.ModuleSpec(ALIAS_MODULE, _TopLoader(), is_package=True)
        if not fullname.startswith(_PREFIX):
            return None
        name = accel_module_name(fullname)
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # "No module named 'accelerate.<sub>'", as for any missing module
        return importlib.machinery.ModuleSpec(
            fullname,
            _SubmoduleLoader(name),
            is_package=found.submodule_search_locations is not None,
        )

    def find_distributions(
        self, context: metadata.DistributionFinder.Context | None = None
    ) -> Iterator[metadata.Distribution]:
        """The in-memory distribution, when asked for all of them or for ``accelerate``."""
        name = getattr(context, "name", None)
        if not self.metadata or (name is not None and name.lower() != ALIAS_MODULE):
            return iter(())
        return iter((_AliasDistribution(),))


def _finder() -> _AliasFinder | None:
    for finder in sys.meta_path:
        if isinstance(finder, _AliasFinder):
            return finder
    return None


def _refuse_foreign() -> None:
    status = alias_status()
    if status.foreign is not None:
        raise AliasError(
            f"accel cannot stand in for accelerate: {status.foreign}. Uninstall it "
            "(`pip uninstall accelerate`) to reach accel through transformers, peft and trl, "
            f"or keep using Accelerate; accel {__version__} changed nothing"
        )


def _activate(spec: importlib.machinery.ModuleSpec | None, *, metadata: bool) -> types.ModuleType:
    module = sys.modules.get(ALIAS_MODULE)
    if isinstance(module, AccelerateModule):
        if _finder() is None:
            sys.meta_path.insert(0, _AliasFinder(metadata=metadata))
        return module
    finder = _AliasFinder(metadata=metadata)
    sys.meta_path.insert(0, finder)
    try:
        alias = _new_alias_module(spec or finder.find_spec(ALIAS_MODULE))
        sys.modules[ALIAS_MODULE] = alias
        # What `accel launch` set, under the names transformers reads (a value the user set
        # under Accelerate's name is kept: accel reports the disagreement when it reads it).
        for name, value in accelerate_spellings(os.environ).items():
            os.environ.setdefault(name, value)
    except BaseException:
        sys.meta_path.remove(finder)
        if sys.modules.get(ALIAS_MODULE) is not module:
            sys.modules.pop(ALIAS_MODULE, None)
        raise
    return alias


def install_as_accelerate() -> types.ModuleType:
    """Make ``import accelerate`` give accel in this interpreter; return the ``accelerate`` module.

    Call it before transformers (or peft, trl, ...) is imported: they check for Accelerate once,
    at import. Calling it again does nothing more.

    Raises:
        AliasError: the real Accelerate is installed, or a module named ``accelerate`` is already
            imported; nothing was changed.
    """
    module = sys.modules.get(ALIAS_MODULE)
    if isinstance(module, AccelerateModule):
        return _activate(module.__spec__, metadata=False)
    _refuse_foreign()
    # Where `accel alias install` wrote the package, its dist-info on disk is the metadata.
    return _activate(None, metadata=alias_status().installed is None)


def activate_installed_alias(module: types.ModuleType) -> None:
    """Run by the ``accelerate`` package that ``accel alias install`` wrote, when imported.

    Replaces that package in ``sys.modules`` by the alias module (the import then returns the
    alias), keeping its spec so ``find_spec("accelerate")`` still points at the file.

    Raises:
        AliasError: the real Accelerate is installed beside the alias's package.
    """
    installed, foreign = alias_distributions()
    if foreign is not None:
        where = installed or os.path.dirname(os.path.dirname(module.__file__ or ""))
        raise AliasError(
            f"this environment holds both accel's accelerate alias ({where}) and {foreign}: "
            "remove one (`accel alias remove`, or `pip uninstall accelerate` twice)"
        )
    sys.modules.pop(ALIAS_MODULE, None)
    _activate(module.__spec__, metadata=False)


def is_alias_active() -> bool:
    """Whether ``accelerate`` is accel's alias in this interpreter (imported or importable)."""
    return isinstance(sys.modules.get(ALIAS_MODULE), AccelerateModule) or _finder() is not None


#: The variable Accelerate's ``Accelerator`` sets when it trains with an engine (transformers
#: reads it: ``is_fsdp_enabled()``, ``TrainingArguments``), by accel's distributed type name.
_ENGINE_SWITCHES = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}


def announce_engine(distributed_type: object) -> None:
    """Set Accelerate's switch for the Accelerator's engine where the alias is active.

    Accelerate's ``Accelerator`` sets ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED``;
    transformers reads them. Nothing is written where the alias is not active.
    """
    name = _ENGINE_SWITCHES.get(str(getattr(distributed_type, "value", distributed_type)))
    if name is not None and is_alias_active():
        os.environ[name] = "true"


def remove_accelerate_alias() -> None:
    """Undo :func:`install_as_accelerate` in this interpreter (tests and notebooks).

    Drops the ``accelerate`` importer and every ``accelerate`` / ``accelerate.*`` entry of
    ``sys.modules`` that is accel's (the accel modules themselves stay imported). Does nothing
    where the alias is not installed.
    """
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AliasFinder)]
    for name in [n for n in sys.modules if n == ALIAS_MODULE or n.startswith(_PREFIX)]:
        module = sys.modules[name]
        owner = getattr(module, "__name__", "")
        if isinstance(module, AccelerateModule) or owner == "accel" or owner.startswith("accel."):
            del sys.modules[name]
