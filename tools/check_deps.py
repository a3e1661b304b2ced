"""Check every package folder against the package graph in tools/packages.toml.

Usage::

    python tools/check_deps.py [--root REPO_ROOT] [--policy tools/packages.toml]

For each folder ``packages/<dist>/`` that exists, this fails (exit code 1, one line per problem,
each naming the package, the dependency and the fix) when:

* ``[project.dependencies]`` or ``[project.optional-dependencies]`` names a sibling that the
  policy does not allow, or an ``accel*`` distribution the policy does not know;
* a sibling dependency is pinned with ``==``/``===`` or a URL, lacks a floor and a cap, or its
  range does not admit the sibling's in-repo version (its ``__about__.py``);
* a third-party dependency is not allowed for that package;
* an ``import``/``from ... import`` anywhere in ``src/`` (function-level imports and
  ``importlib.import_module("...")`` calls included) reaches a sibling that is not allowed, or an
  allowed sibling that is not declared in ``[project.dependencies]``;
* the meta package does not depend on every other package that exists in the tree;
* README.md, CHANGELOG.md (with an ``## Unreleased`` heading), ``src/<import>/__about__.py`` or
  ``src/<import>/py.typed`` is missing;
* the package's ruff ``banned-api`` table does not ban exactly the forbidden siblings, or drops
  an entry of the root table (ruff's ``extend`` replaces that table, it does not merge it);
* its ``torch`` requirement is not ``torch>=F`` where F is the release the ``floor`` session
  installs (``tools/constraints/floor.txt``), which is also ``TORCH_FLOOR`` in
  ``accel_state/torch_support.py``: the declared floor is the tested one.

Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLICY_HELP = "tools/packages.toml (and the graph in docs/architecture.md)"


# --------------------------------------------------------------------------------------------
# Names, requirements and versions (a small PEP 440 / PEP 508 subset; no third-party packages)
# --------------------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """Return the PEP 503 normalized form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


_REQ_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*)$")
_SPEC_RE = re.compile(r"^(~=|===|==|!=|<=|>=|<|>)\s*(\S+)$")


@dataclass(frozen=True)
class Requirement:
    """One parsed dependency string."""

    text: str
    name: str  # normalized
    specs: tuple[tuple[str, str], ...]
    url: str | None


def parse_requirement(text: str) -> Requirement:
    """Parse a PEP 508 string into name, specifiers and URL (markers are dropped)."""
    body = text.split(";", 1)[0].strip()
    match = _REQ_RE.match(body)
    if match is None:
        raise ValueError(f"cannot parse requirement {text!r}")
    name, _extras, rest = match.groups()
    rest = rest.strip()
    if rest.startswith("@"):
        return Requirement(text, normalize(name), (), rest[1:].strip())
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1]
    specs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        spec = _SPEC_RE.match(item)
        if spec is None:
            raise ValueError(f"cannot parse version specifier {item!r} in {text!r}")
        specs.append((spec.group(1), spec.group(2)))
    return Requirement(text, normalize(name), tuple(specs), None)


_VERSION_RE = re.compile(
    r"^v?(?:(?P<epoch>\d+)!)?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre_l>a|alpha|b|beta|c|rc|pre|preview)[-_.]?(?P<pre_n>\d*))?"
    r"(?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d*))?"
    r"(?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?$",
    re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_INF = float("inf")


@dataclass(frozen=True, order=True)
class Version:
    """A PEP 440 version reduced to its comparison key."""

    key: tuple[Any, ...]
    release: tuple[int, ...] = field(compare=False)
    is_pre: bool = field(compare=False)
    is_post: bool = field(compare=False)

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse ``text``; raises ValueError when it is not a PEP 440 version."""
        match = _VERSION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a PEP 440 version")
        g = match.groupdict()
        release = tuple(int(part) for part in g["release"].split("."))
        trimmed = list(release)
        while len(trimmed) > 1 and trimmed[-1] == 0:
            trimmed.pop()
        has_dev = g["dev_l"] is not None
        has_post = g["post_n1"] is not None or g["post_l"] is not None
        pre: tuple[float, float]
        if g["pre_l"] is not None:
            pre = (_PRE_RANK[g["pre_l"].lower()], int(g["pre_n"] or 0))
        elif has_dev and not has_post:
            pre = (-_INF, 0)
        else:
            pre = (_INF, 0)
        post = int(g["post_n1"] or g["post_n2"] or 0) if has_post else -_INF
        dev = int(g["dev_n"] or 0) if has_dev else _INF
        key = (int(g["epoch"] or 0), tuple(trimmed), pre, post, dev)
        return cls(key, release, g["pre_l"] is not None or has_dev, has_post)


def _release_prefix_matches(version: Version, prefix: str) -> bool:
    wanted = [int(part) for part in prefix.split(".")]
    have = list(version.release) + [0] * max(0, len(wanted) - len(version.release))
    return have[: len(wanted)] == wanted


def spec_admits(op: str, spec_version: str, version_text: str) -> bool:
    """Return whether ``version_text`` satisfies the single specifier ``op spec_version``."""
    if op == "===":
        return version_text == spec_version
    version = Version.parse(version_text)
    if op in ("==", "!=") and spec_version.endswith(".*"):
        result = _release_prefix_matches(version, spec_version[:-2])
        return result if op == "==" else not result
    bound = Version.parse(spec_version)
    if op == "==":
        return version == bound
    if op == "!=":
        return version != bound
    if op == ">=":
        return version >= bound
    if op == "<=":
        return version <= bound
    if op == ">":
        return version > bound
    if op == "<":
        # PEP 440: "<1.0" does not admit pre-releases of 1.0 itself.
        same_release = Version.parse(".".join(map(str, version.release))) == Version.parse(
            ".".join(map(str, bound.release))
        )
        return version < bound and not (version.is_pre and not bound.is_pre and same_release)
    if op == "~=":
        parts = spec_version.split("+")[0].split(".")
        prefix = ".".join(re.sub(r"\D.*$", "", part) for part in parts[:-1])
        return version >= bound and _release_prefix_matches(version, prefix)
    raise ValueError(f"unknown version operator {op!r}")


# --------------------------------------------------------------------------------------------
# Policy and package layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row of tools/packages.toml."""

    dist: str
    import_name: str
    internal: frozenset[str]
    third_party: frozenset[str]
    optional: frozenset[str]
    meta: bool


def load_policy(path: Path) -> dict[str, Rule]:
    """Read tools/packages.toml into ``{dist: Rule}``; raises ValueError on a malformed table."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    rules: dict[str, Rule] = {}
    for dist, row in data.get("packages", {}).items():
        if normalize(dist) != dist:
            raise ValueError(
                f"{path}: package key {dist!r} must be normalized ({normalize(dist)!r})"
            )
        rules[dist] = Rule(
            dist=dist,
            import_name=row["import"],
            internal=frozenset(normalize(d) for d in row.get("internal", [])),
            third_party=frozenset(normalize(d) for d in row.get("third_party", [])),
            optional=frozenset(normalize(d) for d in row.get("optional", [])),
            meta=bool(row.get("meta", False)),
        )
    for rule in rules.values():
        unknown = sorted(rule.internal - rules.keys())
        if unknown:
            raise ValueError(f"{path}: {rule.dist} lists unknown internal deps {unknown}")
    return rules


def read_version(about: Path) -> str | None:
    """Return the string assigned to ``__version__`` in an ``__about__.py``, or None."""
    try:
        tree = ast.parse(about.read_text(encoding="utf-8"), filename=str(about))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "__version__":
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
    return None


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Return ``(absolute module name, line)`` for every import in a file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            first = node.args[0]
            if (
                called in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.append((first.value, node.lineno))
    return found


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


class Checker:
    """Collects the problems of every package folder under ``root/packages``."""

    def __init__(self, root: Path, policy_path: Path) -> None:
        self.root = root
        self.policy_path = policy_path
        self.rules = load_policy(policy_path)
        self.by_import = {rule.import_name: rule for rule in self.rules.values()}
        self.problems: list[str] = []
        self.checked: list[str] = []

    def fail(self, dist: str, message: str) -> None:
        self.problems.append(f"[{dist}] {message}")

    def package_dir(self, dist: str) -> Path:
        return self.root / "packages" / dist

    def in_repo_version(self, dist: str) -> str | None:
        rule = self.rules[dist]
        return read_version(self.package_dir(dist) / "src" / rule.import_name / "__about__.py")

    def run(self) -> list[str]:
        packages = self.root / "packages"
        folders = (
            sorted(p.name for p in packages.iterdir() if p.is_dir()) if packages.is_dir() else []
        )
        for folder in folders:
            if folder not in self.rules:
                self.fail(
                    folder,
                    f"packages/{folder}/ has no row in {POLICY_HELP}. Fix: add it there with its "
                    "import name and allowed dependencies, or rename the folder to its "
                    "distribution name.",
                )
        for dist in self.rules:
            if self.package_dir(dist).is_dir():
                self.checked.append(dist)
                self.check_package(self.rules[dist])
        return self.problems

    def check_package(self, rule: Rule) -> None:
        pkg = self.package_dir(rule.dist)
        pyproject_path = pkg / "pyproject.toml"
        if not pyproject_path.is_file():
            self.fail(rule.dist, f"packages/{rule.dist}/pyproject.toml is missing.")
            return
        try:
            pyproject = tomllib.loads(pyproject_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            self.fail(rule.dist, f"packages/{rule.dist}/pyproject.toml is not valid TOML: {exc}")
            return
        project = pyproject.get("project", {})
        name = project.get("name")
        if name is None or normalize(name) != rule.dist:
            self.fail(
                rule.dist,
                f"[project] name is {name!r} in packages/{rule.dist}/pyproject.toml. "
                f"Fix: set name = {rule.dist!r} (the folder name).",
            )
        self.check_files(rule, pkg, pyproject)
        declared = self.check_declared_deps(rule, project)
        self.check_imports(rule, pkg, declared)
        self.check_banned_api(rule, pyproject)
        self.check_torch_floor(rule, project)

    def tested_torch_floor(self) -> str | None:
        """The torch release of tools/constraints/floor.txt (None: no such file)."""
        path = self.root / "tools" / "constraints" / "floor.txt"
        if not path.is_file():
            return None
        for line in path.read_text(encoding="utf-8").splitlines():
            req = line.split("#", 1)[0].strip()
            if req and parse_requirement(req).name == "torch":
                specs = parse_requirement(req).specs
                if len(specs) == 1 and specs[0][0] == "==":
                    return specs[0][1]
        raise ValueError(f"{path} does not pin torch==VERSION")

    def check_torch_floor(self, rule: Rule, project: dict[str, Any]) -> None:
        floor = self.tested_torch_floor()
        if floor is None:
            return
        where = f"packages/{rule.dist}/pyproject.toml [project.dependencies]"
        torch = [
            parse_requirement(text)
            for text in project.get("dependencies", [])
            if parse_requirement(text).name == "torch"
        ]
        specs = torch[0].specs if len(torch) == 1 else ()
        if (
            len(specs) != 1
            or specs[0][0] != ">="
            or Version.parse(specs[0][1]) != Version.parse(floor)
        ):
            self.fail(
                rule.dist,
                f"{where} declares {[r.text for r in torch]} but the floor session tests torch "
                f"{floor} (tools/constraints/floor.txt). Fix: declare exactly 'torch>={floor}', "
                "or move the floor in both places.",
            )
        support = self.root / "packages" / "accel-state" / "src" / "accel_state"
        support = support / "torch_support.py"
        if rule.dist == "accel-state" and support.is_file():
            found = re.search(r'^TORCH_FLOOR = "([^"]+)"', support.read_text("utf-8"), re.M)
            if found is None or Version.parse(found.group(1)) != Version.parse(floor):
                self.fail(
                    rule.dist,
                    f"accel_state/torch_support.py TORCH_FLOOR is "
                    f"{found.group(1) if found else None!r}, but the floor session tests torch "
                    f"{floor}. Fix: make them equal.",
                )

    def check_files(self, rule: Rule, pkg: Path, pyproject: dict[str, Any]) -> None:
        rel = f"packages/{rule.dist}"
        for required in ("README.md", "CHANGELOG.md"):
            if not (pkg / required).is_file():
                self.fail(rule.dist, f"{rel}/{required} is missing. Fix: add it.")
        changelog = pkg / "CHANGELOG.md"
        if changelog.is_file():
            text = changelog.read_text(encoding="utf-8")
            if not re.search(r"^## \[?Unreleased\]?[ \t]*$", text, re.MULTILINE):
                self.fail(
                    rule.dist,
                    f"{rel}/CHANGELOG.md has no '## Unreleased' heading. Fix: add one above the "
                    "newest release; changes go there until tools/bump.py dates them.",
                )
        src = pkg / "src" / rule.import_name
        about = src / "__about__.py"
        if not about.is_file():
            self.fail(rule.dist, f"{rel}/src/{rule.import_name}/__about__.py is missing.")
        elif read_version(about) is None:
            self.fail(
                rule.dist,
                f"{rel}/src/{rule.import_name}/__about__.py does not assign a string literal to "
                '__version__. Fix: __version__ = "X.Y.Z".',
            )
        if not (src / "py.typed").is_file():
            self.fail(
                rule.dist,
                f"{rel}/src/{rule.import_name}/py.typed is missing. Fix: add an empty py.typed "
                "so type checkers use the package's annotations.",
            )
        version_path = pyproject.get("tool", {}).get("hatch", {}).get("version", {}).get("path")
        wanted = f"src/{rule.import_name}/__about__.py"
        if version_path != wanted:
            self.fail(
                rule.dist,
                f"[tool.hatch.version] path is {version_path!r}. Fix: path = {wanted!r}.",
            )

    def check_declared_deps(self, rule: Rule, project: dict[str, Any]) -> set[str]:
        """Check every declared dependency; return the siblings in [project.dependencies]."""
        groups: list[tuple[str, list[str]]] = [
            ("[project.dependencies]", list(project.get("dependencies", [])))
        ]
        for extra, reqs in project.get("optional-dependencies", {}).items():
            groups.append((f"[project.optional-dependencies] {extra}", list(reqs)))
        required_siblings: set[str] = set()
        for where, reqs in groups:
            for text in reqs:
                try:
                    req = parse_requirement(text)
                except ValueError as exc:
                    self.fail(rule.dist, f"{where}: {exc}.")
                    continue
                if req.name == rule.dist:
                    continue  # an extra that points at another extra of the same package
                if req.name in self.rules or req.name == "accel" or req.name.startswith("accel-"):
                    self.check_internal(rule, where, req)
                    if where == "[project.dependencies]":
                        required_siblings.add(req.name)
                    continue
                allowed = rule.third_party | (rule.optional if "optional" in where else set())
                if req.name not in allowed:
                    kind = "runtime" if where == "[project.dependencies]" else "optional"
                    self.fail(
                        rule.dist,
                        f"{where}: third-party {kind} dependency {text!r} is not allowed for "
                        f"{rule.dist} (allowed: {', '.join(sorted(allowed)) or 'none'}). Fix: "
                        f"drop it, or add {req.name!r} to {rule.dist}'s third_party/optional "
                        f"list in {POLICY_HELP}.",
                    )
        if rule.meta:
            # Only siblings that exist in this tree: one without a folder has nothing to
            # publish yet, and a dependency on it would resolve to whatever the index holds.
            others = sorted(
                d for d in set(self.rules) - {rule.dist} if self.package_dir(d).is_dir()
            )
            missing = [d for d in others if d not in required_siblings]
            if missing:
                self.fail(
                    rule.dist,
                    f"the meta package must depend on every other package; [project.dependencies] "
                    f"lacks {', '.join(missing)}. Fix: add e.g. "
                    f"{self.suggest_range(missing[0])!r}.",
                )
        return required_siblings

    def suggest_range(self, sibling: str) -> str:
        version = self.in_repo_version(sibling)
        if version is None:
            return f"{sibling}>=X.Y,<X.(Y+1)"
        try:
            release = Version.parse(version).release
        except ValueError:
            return f"{sibling}>=X.Y,<X.(Y+1)"
        major, minor = (list(release) + [0, 0])[:2]
        cap = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
        return f"{sibling}>={major}.{minor},<{cap}"

    def check_internal(self, rule: Rule, where: str, req: Requirement) -> None:
        sibling = req.name
        if sibling not in self.rules:
            self.fail(
                rule.dist,
                f"{where}: {req.text!r} names {sibling!r}, which is not a package in "
                f"{POLICY_HELP}. Fix: drop it, or add the package to the policy first.",
            )
            return
        if sibling not in rule.internal:
            allowed = ", ".join(sorted(rule.internal)) or "no sibling"
            self.fail(
                rule.dist,
                f"{where}: dependency on {sibling!r} ({req.text!r}) is not allowed; "
                f"{rule.dist} may depend on {allowed}. Fix: remove it (move the shared code "
                f"down into accel-state if two packages need it), or change {POLICY_HELP}.",
            )
            return
        fix = f"Fix: use a range such as {self.suggest_range(sibling)!r}."
        if req.url is not None:
            self.fail(
                rule.dist,
                f"{where}: {req.text!r} points {sibling} at a URL; siblings take a version "
                f"range. {fix}",
            )
            return
        ops = [op for op, _ in req.specs]
        if any(op in ("==", "===") for op in ops):
            self.fail(
                rule.dist,
                f"{where}: {req.text!r} pins {sibling} with '=='; siblings release "
                f"independently and must use a range, never '=='. {fix}",
            )
            return
        has_floor = any(op in (">=", ">", "~=") for op in ops)
        has_cap = any(op in ("<", "<=", "~=") for op in ops)
        if not (has_floor and has_cap):
            lacking = " and ".join(
                word for word, ok in (("a floor", has_floor), ("a cap", has_cap)) if not ok
            )
            self.fail(rule.dist, f"{where}: {req.text!r} lacks {lacking} for {sibling}. {fix}")
            return
        version = self.in_repo_version(sibling)
        if version is None:
            if not self.package_dir(sibling).is_dir():
                self.fail(
                    rule.dist,
                    f"{where}: depends on {sibling}, whose folder packages/{sibling}/ does not "
                    "exist in this tree. Fix: add the package before depending on it.",
                )
            return  # the sibling's own check reports its missing/invalid __about__.py
        try:
            admitted = all(spec_admits(op, bound, version) for op, bound in req.specs)
        except ValueError as exc:
            self.fail(rule.dist, f"{where}: {req.text!r}: {exc}.")
            return
        if not admitted:
            about = f"packages/{sibling}/src/{self.rules[sibling].import_name}/__about__.py"
            self.fail(
                rule.dist,
                f"{where}: range {req.text!r} does not admit {sibling}'s in-repo version "
                f"{version} ({about}); the tree would test a combination that the published "
                f"metadata forbids. {fix}",
            )

    def check_imports(self, rule: Rule, pkg: Path, declared: set[str]) -> None:
        src = pkg / "src" / rule.import_name
        if not src.is_dir():
            self.fail(rule.dist, f"packages/{rule.dist}/src/{rule.import_name}/ is missing.")
            return
        allowed_imports = {self.rules[d].import_name for d in rule.internal}
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(self.root).as_posix()
            try:
                modules = imported_modules(path)
            except SyntaxError as exc:
                self.fail(rule.dist, f"{rel}: cannot parse ({exc.msg} at line {exc.lineno}).")
                continue
            for module, line in modules:
                top = module.split(".", 1)[0]
                target = self.by_import.get(top)
                if target is None or target.dist == rule.dist:
                    continue
                if top not in allowed_imports:
                    allowed = ", ".join(sorted(allowed_imports)) or "no sibling"
                    self.fail(
                        rule.dist,
                        f"{rel}:{line} imports {module} (distribution {target.dist}); "
                        f"{rule.dist} may import {allowed}. Fix: remove the import (move the "
                        f"shared code into accel-state if two packages need it), or change "
                        f"{POLICY_HELP}.",
                    )
                elif target.dist not in declared:
                    self.fail(
                        rule.dist,
                        f"{rel}:{line} imports {module}, but [project.dependencies] does not "
                        f"declare {target.dist}. Fix: add {self.suggest_range(target.dist)!r}.",
                    )

    def root_banned_api(self) -> dict[str, Any]:
        root_pyproject = self.root / "pyproject.toml"
        if not root_pyproject.is_file():
            return {}
        data = tomllib.loads(root_pyproject.read_text(encoding="utf-8"))
        return dict(_dig(data, "tool", "ruff", "lint", "flake8-tidy-imports", "banned-api"))

    def check_banned_api(self, rule: Rule, pyproject: dict[str, Any]) -> None:
        table = (
            f"packages/{rule.dist}/pyproject.toml [tool.ruff.lint.flake8-tidy-imports.banned-api]"
        )
        ruff = _dig(pyproject, "tool", "ruff")
        if ruff.get("extend") != "../../pyproject.toml":
            self.fail(
                rule.dist,
                f"packages/{rule.dist}/pyproject.toml [tool.ruff] does not extend the root "
                'config. Fix: extend = "../../pyproject.toml".',
            )
        banned = dict(_dig(ruff, "lint", "flake8-tidy-imports", "banned-api"))
        sibling_imports = {r.import_name for r in self.rules.values() if r.dist != rule.dist}
        allowed_imports = {self.rules[d].import_name for d in rule.internal}
        forbidden = sibling_imports - allowed_imports
        banned_siblings = {key for key in banned if key in sibling_imports}
        missing = sorted(forbidden - banned_siblings)
        extra = sorted(banned_siblings & allowed_imports)
        if missing:
            lines = "; ".join(f'"{m}".msg = "..."' for m in missing)
            self.fail(
                rule.dist,
                f"{table} does not ban the forbidden siblings {', '.join(missing)}. Fix: add "
                f"{lines}.",
            )
        if extra:
            self.fail(
                rule.dist,
                f"{table} bans {', '.join(extra)}, which {rule.dist} is allowed to import. Fix: "
                "remove those entries (or change the policy).",
            )
        partial = sorted(
            key
            for key in banned
            if "." in key and key.split(".", 1)[0] in sibling_imports and key not in forbidden
        )
        if partial:
            self.fail(
                rule.dist,
                f"{table} bans submodules {', '.join(partial)}; ban whole siblings only. Fix: "
                "ban the top-level import name, or nothing if the sibling is allowed.",
            )
        dropped = sorted(set(self.root_banned_api()) - set(banned))
        if dropped:
            self.fail(
                rule.dist,
                f"{table} lacks the root entries {', '.join(dropped)}; ruff's `extend` replaces "
                "this table instead of merging it. Fix: repeat them in the package table.",
            )


def _dig(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        value = data.get(key, {})
        data = value if isinstance(value, dict) else {}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="repository root (default: %(default)s)"
    )
    parser.add_argument(
        "--policy", type=Path, default=None, help="policy file (default: ROOT/tools/packages.toml)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    policy = args.policy or root / "tools" / "packages.toml"
    try:
        checker = Checker(root, policy)
    except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"check_deps: cannot read the policy {policy}: {exc!r}", file=sys.stderr)
        return 2
    problems = checker.run()
    for problem in problems:
        print(f"check_deps: {problem}", file=sys.stderr)
    waiting = sorted(set(checker.rules) - set(checker.checked))
    if problems:
        print(
            f"check_deps: FAILED: {len(problems)} problem(s) in "
            f"{len({p.split(']', 1)[0] for p in problems})} package(s).",
            file=sys.stderr,
        )
        return 1
    note = f"; no folder yet for {', '.join(waiting)}" if waiting else ""
    print(f"check_deps: OK: checked {', '.join(checker.checked) or 'no package'}{note}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
