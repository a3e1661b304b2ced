"""Guard a nox session's environment: exactly the expected accel distributions, installed right.

Usage::

    python tools/check_installed.py --mode editable --expect accel-state accel-data
    python tools/check_installed.py --mode wheel --expect accel-state

Fails (exit code 1) when an accel distribution (any name in tools/packages.toml, or ``accel`` /
``accel-*``) is installed but not expected (for example one from an index, outside this tree),
when an expected one is missing or installed twice, and when the install mode is wrong:
``editable`` requires an editable install of ``packages/<dist>`` of this checkout; ``wheel``
requires a regular install from a local ``.whl`` file (not from an index, not editable).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections import defaultdict
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO_ROOT = Path(__file__).resolve().parents[1]


def normalize(name: str) -> str:
    """Return the PEP 503 normalized form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check which accel distributions are installed.")
    parser.add_argument("--mode", choices=("editable", "wheel"), required=True)
    parser.add_argument("--expect", nargs="+", required=True, help="distribution names")
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    root: Path = args.repo_root.resolve()
    policy = tomllib.loads((root / "tools" / "packages.toml").read_text(encoding="utf-8"))
    known = {normalize(name) for name in policy.get("packages", {})}
    expected = {normalize(name) for name in args.expect}

    found: dict[str, list[metadata.Distribution]] = defaultdict(list)
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name in known or name == "accel" or name.startswith("accel-"):
            found[name].append(dist)

    problems: list[str] = []
    for name in sorted(set(found) - expected):
        problems.append(
            f"{name} is installed but is not in this session's closure "
            f"({', '.join(sorted(expected))}); a sibling or an outside copy leaked in"
        )
    for name in sorted(expected - set(found)):
        problems.append(f"{name} is not installed")
    lines = []
    for name in sorted(expected & set(found)):
        copies = found[name]
        if len(copies) > 1:
            problems.append(f"{name} is installed {len(copies)} times")
        dist = copies[0]
        raw = dist.read_text("direct_url.json")
        info = json.loads(raw) if raw else {}
        editable = bool(info.get("dir_info", {}).get("editable", False))
        url = info.get("url", "")
        location = Path(unquote(urlparse(url).path)).resolve() if url.startswith("file:") else None
        source = root / "packages" / name
        if args.mode == "editable":
            if not editable:
                problems.append(f"{name} {dist.version} is not an editable install")
            elif location != source:
                problems.append(f"{name} is editable from {location}, not from {source}")
        elif editable:
            problems.append(f"{name} is an editable install; this session needs the wheel")
        elif "archive_info" not in info or not url.endswith(".whl"):
            problems.append(
                f"{name} {dist.version} was not installed from a local wheel file "
                f"(direct_url.json: {info or 'absent, so it came from an index'})"
            )
        elif location is not None and location.is_relative_to(root / "packages"):
            problems.append(f"{name} was installed from the source tree ({location})")
        lines.append(f"{name} {dist.version} ({'editable' if editable else 'wheel'})")

    for problem in problems:
        print(f"check_installed: FAIL: {problem}")
    status = "FAILED" if problems else "OK"
    print(f"check_installed: {status}: {'; '.join(lines) or 'no accel distribution'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
