"""Check built wheels and sdists before they are published.

Usage (the ``build`` nox session runs it on what it just built)::

    python tools/check_dists.py dist/ [--repo-root REPO_ROOT] [--no-twine]

Fails (exit code 1) unless:

* every existing package folder has exactly one wheel and one sdist in the folder, and every file
  belongs to a package of tools/packages.toml;
* each wheel's METADATA Name/Version match the package name and its ``__about__.py``; the wheel
  contains ``<import>/py.typed``, nothing but ``<import>/`` and its ``.dist-info``, and no
  ``tests/`` folder or ``conftest.py``;
* each sdist's PKG-INFO Name/Version match; it contains README.md, CHANGELOG.md, pyproject.toml
  and ``src/<import>/__about__.py``;
* ``twine check --strict`` accepts every file (skipped with ``--no-twine``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path, PurePosixPath

from check_deps import Rule, load_policy, normalize, read_version

REPO_ROOT = Path(__file__).resolve().parents[1]


def _metadata(text: str) -> tuple[str, str]:
    message = Parser().parsestr(text)
    return message.get("Name", ""), message.get("Version", "")


def _expect_meta(
    problems: list[str], label: str, name: str, version: str, rule: Rule, wanted: str | None
) -> None:
    if normalize(name) != rule.dist:
        problems.append(f"{label}: metadata Name is {name!r}, expected {rule.dist!r}")
    if wanted is None:
        problems.append(f"{label}: cannot read __version__ of {rule.dist} in this checkout")
    elif version != wanted:
        problems.append(
            f"{label}: metadata Version is {version!r} but "
            f"packages/{rule.dist}/src/{rule.import_name}/__about__.py says {wanted!r}; "
            "rebuild from a clean tree"
        )


def check_wheel(path: Path, rule: Rule, wanted: str | None, problems: list[str]) -> None:
    """Check one wheel's metadata and contents."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metas = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(metas) != 1:
            problems.append(f"{path.name}: expected one .dist-info/METADATA, found {metas}")
            return
        name, version = _metadata(archive.read(metas[0]).decode("utf-8"))
    _expect_meta(problems, path.name, name, version, rule, wanted)
    dist_info = metas[0].split("/", 1)[0]
    if f"{rule.import_name}/py.typed" not in names:
        problems.append(f"{path.name}: {rule.import_name}/py.typed is missing")
    for entry in names:
        parts = PurePosixPath(entry).parts
        if parts[0] not in (rule.import_name, dist_info):
            problems.append(f"{path.name}: unexpected top-level entry {entry!r}")
        if "tests" in parts[:-1] or parts[-1] == "conftest.py":
            problems.append(f"{path.name}: test file {entry!r} must not ship in the wheel")


def check_sdist(path: Path, rule: Rule, wanted: str | None, problems: list[str]) -> None:
    """Check one sdist's metadata and that the files users need are inside."""
    with tarfile.open(path) as archive:
        members = {m.name: m for m in archive.getmembers()}
        top = sorted({name.split("/", 1)[0] for name in members})
        if len(top) != 1:
            problems.append(f"{path.name}: expected one top-level folder, found {top}")
            return
        base = top[0]
        needed = [
            "PKG-INFO",
            "pyproject.toml",
            "README.md",
            "CHANGELOG.md",
            f"src/{rule.import_name}/__about__.py",
        ]
        for item in needed:
            if f"{base}/{item}" not in members:
                problems.append(f"{path.name}: {item} is missing")
        info = members.get(f"{base}/PKG-INFO")
        handle = archive.extractfile(info) if info is not None else None
        if handle is None:
            return
        name, version = _metadata(handle.read().decode("utf-8"))
    _expect_meta(problems, path.name, name, version, rule, wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check built wheels and sdists.")
    parser.add_argument("dist_dir", type=Path)
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT)
    parser.add_argument("--no-twine", action="store_true", help="skip `twine check --strict`")
    args = parser.parse_args(argv)
    root: Path = args.repo_root.resolve()
    rules = load_policy(root / "tools" / "packages.toml")
    by_file_stem = {rule.import_name.replace("-", "_"): rule for rule in rules.values()}
    by_file_stem.update({rule.dist.replace("-", "_"): rule for rule in rules.values()})
    existing = [d for d in rules if (root / "packages" / d).is_dir()]

    files = sorted(
        p for p in args.dist_dir.iterdir() if p.suffix == ".whl" or p.name.endswith(".tar.gz")
    )
    problems: list[str] = []
    seen: dict[tuple[str, str], list[str]] = {}
    for path in files:
        stem = path.name.split("-", 1)[0].lower()
        rule = by_file_stem.get(stem)
        if rule is None:
            problems.append(f"{path.name} does not belong to any package in tools/packages.toml")
            continue
        kind = "wheel" if path.suffix == ".whl" else "sdist"
        seen.setdefault((rule.dist, kind), []).append(path.name)
        about = root / "packages" / rule.dist / "src" / rule.import_name / "__about__.py"
        wanted = read_version(about)
        if kind == "wheel":
            check_wheel(path, rule, wanted, problems)
        else:
            check_sdist(path, rule, wanted, problems)
    for dist in existing:
        for kind in ("wheel", "sdist"):
            built = seen.get((dist, kind), [])
            if len(built) != 1:
                problems.append(
                    f"{dist}: expected exactly one {kind} in {args.dist_dir}, found {built}"
                )

    if not files:
        problems.append(f"no wheel or sdist in {args.dist_dir}")
    elif not args.no_twine:
        twine = subprocess.run(
            [sys.executable, "-m", "twine", "check", "--strict", *map(str, files)], check=False
        )
        if twine.returncode != 0:
            problems.append(f"twine check --strict failed (exit code {twine.returncode})")

    for problem in problems:
        print(f"check_dists: FAIL: {problem}")
    status = "FAILED" if problems else "OK"
    names = ", ".join(p.name for p in files)
    print(f"check_dists: {status}: {len(files)} file(s) in {args.dist_dir}: {names}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
