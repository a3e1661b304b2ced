"""Reading a launch config file's text into a checked mapping (:func:`read_config_mapping`).

Every way a file can be wrong before its keys mean anything is refused here, with one message
naming the file, where in it and the fix: it cannot be read, is over 1 MiB, is not UTF-8, is
not YAML (or JSON, for a ``.json`` name, as Accelerate reads it), gives a key two different
values, is not a mapping, or its YAML aliases make it larger or deeper than any launch config
(the "billion laughs" file) or make it contain itself. The keys and values are checked by
:mod:`accel_launch.config`.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["FRESH_FILE", "read_config_mapping", "shown"]

#: Limits on what a config file may hold; a launch config is a few hundred bytes and a few
#: dozen values, so these refuse only the wrong file or a YAML alias bomb, never a real config.
_MAX_CONFIG_BYTES = 1 << 20
_MAX_CONFIG_VALUES = 10_000
_MAX_CONFIG_DEPTH = 32
FRESH_FILE = "`accel config default --config_file NEW.yaml` writes a valid one"


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut short: a message quotes a value, never a whole section."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_config_mapping(file: Path) -> Mapping[Any, Any]:
    """The mapping a config file holds, read and parsed safely and checked for its extent.

    Raises:
        PermissionError: the file cannot be read by this user.
        OSError: reading it failed otherwise.
        ValueError: larger than 1 MiB, not UTF-8, not YAML (JSON for a ``.json`` name), a key
            with two values, not a mapping, more than 10,000 values or 32 levels (YAML aliases
            included), or a section containing itself.
    """
    data = _parse_config_text(_read_config_text(file), file)
    if not isinstance(data, Mapping):
        raise ValueError(
            f"The config file at {file} must hold a mapping of keys to values, such as "
            f"`distributed_type: MULTI_CPU`, but {_not_a_mapping(data)}: {FRESH_FILE}"
        )
    _check_extent(data, file)
    return data


class _DuplicateKeyError(ValueError):
    """A mapping of a config file gives one key twice (raised while parsing)."""

    def __init__(self, key: Any, lines: tuple[int, int] | None = None) -> None:
        super().__init__(key, lines)
        self.key = key
        self.lines = lines


def _same_scalar(first: yaml.Node, second: yaml.Node) -> bool:
    return (
        isinstance(first, yaml.ScalarNode)
        and isinstance(second, yaml.ScalarNode)
        and (first.tag, first.value) == (second.tag, second.value)
    )


class _CheckedYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice, with two values, in one mapping.

    PyYAML keeps the last of two equal keys; YAML itself forbids them, and a launch config
    that says ``num_processes`` twice has no single meaning. A key repeated with the same
    plain value means one thing, and files of old Accelerate releases have them
    (``debug: false`` twice), so that repetition is read.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, tuple[int, yaml.Node]] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # a merge key (``<<``) may be overridden; complex keys fail below
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen and not _same_scalar(seen[key][1], value_node):
                raise _DuplicateKeyError(key, (seen[key][0], line))
            seen.setdefault(key, (line, value_node))
        return super().construct_mapping(node, deep=deep)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result and result[key] != value:  # the same value twice means one thing
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _line_and_column(text: str | bytes, offset: int) -> str:
    """``"line L, column C"`` of ``offset`` (for bytes, the column counts bytes)."""
    if isinstance(text, bytes):
        text = text[:offset].decode("latin-1")  # one character per byte
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}"


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """One line from a PyYAML error: where (line and column of the file) and what."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        problem = error.problem or error.context or "invalid YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        if error.problem and error.context:
            problem = f"{problem} ({error.context})"
        return " ".join(f"{where}{problem}".split())
    if isinstance(error, yaml.reader.ReaderError):
        where = _line_and_column(text, error.position)
        character = error.character
        shown = chr(character) if isinstance(character, int) else character
        return f"{where}: the character {shown!r} is not allowed in YAML"
    return " ".join(str(error).split())


def _read_config_text(file: Path) -> str:
    """The text of a config file; every way reading it can fail is one message naming it."""
    try:
        with file.open("rb") as handle:
            raw = handle.read(_MAX_CONFIG_BYTES + 1)
    except PermissionError:
        raise PermissionError(
            f"the config file {file} cannot be read (permission denied): make it readable "
            f"(`chmod u+r {file}`), or pass another file with --config_file"
        ) from None
    except OSError as error:
        raise OSError(
            f"the config file {file} cannot be read ({error.strerror or error}): pass a "
            "readable file with --config_file"
        ) from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ValueError(
            f"The config file at {file} is larger than {_MAX_CONFIG_BYTES // 2**20} MiB, and a "
            f"launch config is a few hundred bytes: is this the right file? {FRESH_FILE}"
        )
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"The config file at {file} is not UTF-8 text: the byte {raw[error.start]:#04x} at "
            f"{_line_and_column(raw, error.start)} is not valid UTF-8 (is it the right file, "
            f"or was it damaged?): save it as UTF-8; {FRESH_FILE}"
        ) from None


def _parse_config_text(text: str, file: Path) -> Any:
    """Parse as JSON (a ``.json`` name, as Accelerate does) or YAML; None when empty."""
    if not text.strip():
        return None
    is_json = file.suffix.lower() == ".json"
    kind = "JSON (a file named *.json is read as JSON)" if is_json else "YAML or JSON"
    try:
        if is_json:
            return json.loads(text, object_pairs_hook=_json_object)
        return yaml.load(text, Loader=_CheckedYamlLoader)  # a SafeLoader: no Python tags
    except _DuplicateKeyError as error:
        where = f" (lines {error.lines[0]} and {error.lines[1]})" if error.lines else ""
        raise ValueError(
            f"The config file at {file} gives the key {shown(error.key)} twice{where}, with "
            "two values, so which one counts is unclear: keep one of them"
        ) from None
    except RecursionError:
        problem = "it nests brackets or sections too deeply to read"
    except json.JSONDecodeError as error:
        problem = f"line {error.lineno}, column {error.colno}: {error.msg.removesuffix(' at')}"
    except yaml.YAMLError as error:
        problem = _yaml_problem(error, text)
    raise ValueError(
        f"The config file at {file} is not valid {kind}: {problem}. Correct the file there; "
        f"{FRESH_FILE}"
    )


def _check_extent(data: Mapping[Any, Any], file: Path) -> None:
    """Refuse a mapping that no launch config needs: too many values, too deep, or a cycle.

    YAML aliases (``*name``) reuse a whole anchored value, so a small file can stand for
    billions of values (the "billion laughs" file) or contain itself. Both are cheap to
    parse, since PyYAML shares the aliased objects, but would never end once walked, printed
    or written. This walk stops at the first limit it meets.
    """
    count = 0

    def visit(value: Any, key: str, depth: int, path: set[int]) -> None:
        nonlocal count
        count += 1
        if count > _MAX_CONFIG_VALUES:
            raise ValueError(
                f"The config file at {file} holds more than {_MAX_CONFIG_VALUES} values (under "
                f"the key {key!r}), where a launch config holds a few dozen; YAML aliases "
                "(`*name`) repeat whole sections: write the values out without them"
            )
        if not isinstance(value, (Mapping, list)):
            return
        if id(value) in path:
            raise ValueError(
                f"The config file at {file} has a section under the key {key!r} that contains "
                "itself (a YAML alias `*name` inside its own anchor `&name`): write the values "
                "out without the alias"
            )
        if depth >= _MAX_CONFIG_DEPTH:
            raise ValueError(
                f"The config file at {file} nests values more than {_MAX_CONFIG_DEPTH} levels "
                f"deep under the key {key!r}; a launch config has a key and the keys of its "
                "sections (such as fsdp_config): flatten it"
            )
        path.add(id(value))
        for item in value.values() if isinstance(value, Mapping) else value:
            visit(item, key, depth + 1, path)
        path.discard(id(value))

    for key, value in data.items():
        visit(value, str(key), 1, set())


def _not_a_mapping(data: Any) -> str:
    if data is None:
        return "it is empty (no keys, only comments, or null)"
    if isinstance(data, list):
        return f"it holds a list ({shown(data)})"
    if isinstance(data, str):
        return f"it holds the text {shown(data)}"
    return f"it holds the value {shown(data)}"
