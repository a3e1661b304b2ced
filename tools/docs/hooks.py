"""MkDocs hook: the API reference, generated from each package's ``__all__`` at build time.

mkdocs.yml names this file under ``hooks:``. A page under docs/api/ holds a directive, an HTML
comment ``<!-- accel-api: MODULE -->`` (MODULE is one of EXPORTERS, or ``index`` for the
overview table), which this hook replaces with one mkdocstrings block (``::: path``) per public
name of MODULE, so that a new public name shows up by itself.

The packages expose many names lazily (module ``__getattr__`` and ``TYPE_CHECKING`` imports)
and re-export each other's names, so a name is documented where it is defined: the names are
read from the imported packages' ``__all__`` (accel's ``__all__`` and ``accel.utils``' too),
and each is resolved to its defining object (the runtime ``__module__``/``__qualname__`` of a
class or function, else griffe's alias resolution for constants). Each object is rendered
once, on the page of the first module in EXPORTERS whose ``__all__`` names it; the other
modules that export it link there. Accelerate names that accel only refuses
(``accel.unavailable``) are listed in a table with the message they raise.

The build fails (a warning under ``strict: true``) when a public class or function has no
docstring, when a public name cannot be resolved, or when a public name is not rendered
anywhere on the site (its anchor id is checked in the built HTML).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import griffe
from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("accel-api")

ROOT = Path(__file__).resolve().parents[2]
#: Modules whose ``__all__`` is public API, in the order that decides where a name is rendered.
EXPORTERS = {
    "accel_state": "api/accel-state.md",
    "accel_data": "api/accel-data.md",
    "accel_amp": "api/accel-amp.md",
    "accel_bigmodel": "api/accel-bigmodel.md",
    "accel_launch": "api/accel-launch.md",
    "accel": "api/accel.md",
    "accel.utils": "api/accel-utils.md",
}
SEARCH_PATHS = [
    ROOT / "packages" / dist / "src"
    for dist in sorted(
        {"accel-state", "accel-data", "accel-amp", "accel-bigmodel", "accel-launch", "accel"}
    )
]
UNAVAILABLE = "accel.unavailable"
DIRECTIVE = re.compile(r"^<!--\s*accel-api:\s*(\S+)\s*-->\s*$", re.MULTILINE)
ANCHOR = re.compile(r'\bid="([^"]+)"')
GROUPS = {
    "class": "Classes",
    "function": "Functions",
    "attribute": "Constants and type aliases",
    "module": "Modules",
    "unavailable": "Accelerate names that accel refuses",
}


@dataclass(frozen=True)
class Entry:
    """One public name: where it is exported, what it is, and the object that documents it."""

    exporter: str  # "accel"
    name: str  # "PartialState"
    target: str  # "accel_state.partial_state.PartialState": the rendered object, its anchor id
    kind: str  # a key of GROUPS
    note: str = ""  # unavailable names: the message they raise

    @property
    def public(self) -> str:
        return f"{self.exporter}.{self.name}"


class Plan:
    """Every public name resolved, and which page renders each object."""

    def __init__(self) -> None:
        self.entries: dict[str, list[Entry]] = {module: [] for module in EXPORTERS}
        self.owner: dict[str, str] = {}  # target -> the exporter whose page renders it
        self.problems: list[str] = []
        self.seen_ids: set[str] = set()
        self.checked: set[str] = set()  # objects whose docstring was checked (reported once)
        loader = griffe.GriffeLoader(
            search_paths=[str(path) for path in SEARCH_PATHS],
            docstring_parser=griffe.Parser.google,
            extensions=griffe.load_extensions(str(Path(__file__).with_name("griffe_ext.py"))),
        )
        for package in dict.fromkeys(module.split(".")[0] for module in EXPORTERS):
            loader.load(package)
        loader.resolve_aliases(implicit=False, external=False)
        self.collection = loader.modules_collection
        for exporter in EXPORTERS:
            module = importlib.import_module(exporter)
            for name in getattr(module, "__all__", []):
                if name.startswith("__"):  # __version__: named on api/index.md
                    continue
                entry = self._resolve(exporter, name, getattr(module, name))
                if entry is not None:
                    self.entries[exporter].append(entry)
                    self.owner.setdefault(entry.target, exporter)

    def _resolve(self, exporter: str, name: str, value: Any) -> Entry | None:
        runtime_path = None
        if inspect.ismodule(value):
            runtime_path = value.__name__
        elif inspect.isclass(value) or inspect.isroutine(value):
            module, qualname = getattr(value, "__module__", ""), getattr(value, "__qualname__", "")
            if module == UNAVAILABLE:
                note = inspect.getdoc(value) or ""
                return Entry(exporter, name, f"{UNAVAILABLE}.{qualname}", "unavailable", note)
            runtime_path = f"{module}.{qualname}"
        try:
            if runtime_path and "<" not in runtime_path and runtime_path in self.collection:
                obj = self.collection[runtime_path]
            else:
                obj = self.collection[f"{exporter}.{name}"]
            if obj.is_alias:
                obj = obj.final_target
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as error:
            self.problems.append(f"{exporter}.{name}: griffe cannot find its definition ({error})")
            return None
        kind = obj.kind.value
        if kind == "type alias":
            kind = "attribute"
        elif kind == "attribute" and (inspect.isclass(value) or inspect.isroutine(value)):
            kind = "function"  # a function built at import time (a decorator factory's result)
        needs_doc = kind in ("class", "function", "module") and obj.path not in self.checked
        self.checked.add(obj.path)
        if needs_doc and not (obj.docstring and obj.docstring.value.strip()):
            where = f"{obj.relative_filepath}:{obj.lineno}"
            self.problems.append(f"{exporter}.{name} ({obj.path}, {where}) has no docstring")
        return Entry(exporter, name, obj.path, kind)

    def expected_ids(self) -> dict[str, str]:
        """Anchor id -> a public name it documents, for every public name."""
        return {e.target: e.public for entries in self.entries.values() for e in entries}

    def render(self, exporter: str) -> str:
        """The Markdown that documents ``exporter``'s public names."""
        own: dict[str, Entry] = {}  # target -> the first of exporter's names for it
        for entry in self.entries[exporter]:
            if self.owner[entry.target] == exporter:
                own.setdefault(entry.target, entry)
        parts: list[str] = []
        for kind, title in GROUPS.items():
            group = sorted((e for e in own.values() if e.kind == kind), key=_key)
            if not group:
                continue
            parts.append(f"## {title}\n")
            if kind == "unavailable":
                parts.append(_unavailable_table(group))
                continue
            parts.extend(_block(entry) for entry in group)
        rendered = set(map(id, own.values()))
        parts.append(
            self._elsewhere(exporter, [e for e in self.entries[exporter] if id(e) not in rendered])
        )
        return "\n".join(part for part in parts if part)

    def _elsewhere(self, exporter: str, others: list[Entry]) -> str:
        if not others:
            return ""
        lines = [
            "## Documented under another name\n",
            f"These names of `{exporter}` are objects that a module earlier in the "
            "[list](index.md) exports too (or another name of this module): each object is "
            "documented once, where it is first exported.\n",
        ]
        for owner in EXPORTERS:
            entries = sorted((e for e in others if self.owner[e.target] == owner), key=_key)
            if entries:
                links = ", ".join(_link(e, exporter, owner) for e in entries)
                lines.append(f"- from `{owner}`: {links}")
        return "\n".join(lines) + "\n"

    def index_table(self) -> str:
        """The overview table of api/index.md: one row per module, with counts."""
        rows = ["| module | page | classes | functions | other |", "|---|---|---|---|---|"]
        for exporter, page in EXPORTERS.items():
            entries = self.entries[exporter]
            count = {k: sum(1 for e in entries if e.kind == k) for k in GROUPS}
            other = count["attribute"] + count["module"] + count["unavailable"]
            link = f"[{exporter}]({Path(page).name})"
            rows.append(
                f"| `{exporter}` | {link} | {count['class']} | {count['function']} | {other} |"
            )
        return "\n".join(rows) + "\n"


def _key(entry: Entry) -> str:
    return entry.name.lower()


def _block(entry: Entry) -> str:
    options = "\n".join(
        [
            f"::: {entry.target}",
            "    options:",
            f'      heading: "{entry.public}"',
            f'      toc_label: "{entry.name}"',
            *(["      members: false"] if entry.kind == "module" else []),
        ]
    )
    return options + "\n"


def _unavailable_table(group: list[Entry]) -> str:
    rows = [
        "Importing these works; calling one, or building one, raises `NotImplementedError` "
        "with the message below.\n",
        "| name | message |",
        "|---|---|",
    ]
    for entry in group:
        message = entry.note.replace("|", "\\|").replace("\n", " ")
        rows.append(f'| <code id="{entry.target}">{entry.public}</code> | {message} |')
    return "\n".join(rows) + "\n"


def _link(entry: Entry, exporter: str, owner: str) -> str:
    label = f"`{entry.name}`"
    if entry.kind == "unavailable":
        page = Path(EXPORTERS[owner]).name
        return f"[{label}]({page}#{entry.target})" if owner != exporter else label
    return f"[{label}][{entry.target}]"


_PLAN: Plan | None = None


def on_config(config: Any, **kwargs: Any) -> Any:
    """Resolve every public name once per build; report names without a docstring."""
    global _PLAN
    _PLAN = Plan()
    for problem in _PLAN.problems:
        log.warning(problem)
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace each ``<!-- accel-api: MODULE -->`` directive with MODULE's reference."""
    assert _PLAN is not None
    plan = _PLAN

    def expand(match: re.Match[str]) -> str:
        module = match.group(1)
        if module == "index":
            return plan.index_table()
        if module not in EXPORTERS:
            log.warning(f"{page.file.src_uri}: unknown module in {match.group(0)!r}")
            return ""
        return plan.render(module)

    return DIRECTIVE.sub(expand, markdown)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Collect the anchor ids of every rendered page (for the check in on_post_build)."""
    if _PLAN is not None:
        _PLAN.seen_ids.update(ANCHOR.findall(html))
    return html


def on_post_build(config: Any, **kwargs: Any) -> None:
    """Fail the build when a public name is rendered nowhere on the site."""
    if _PLAN is None:
        return
    missing = {i: p for i, p in _PLAN.expected_ids().items() if i not in _PLAN.seen_ids}
    for anchor, public in sorted(missing.items()):
        log.warning(f"{public} is public but not rendered in the API reference (id {anchor!r})")
