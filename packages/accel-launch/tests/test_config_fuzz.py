"""Fuzzing what users hand to ``accel launch`` as a config file (issue 31).

Two realistic configs (a 2-process MULTI_CPU one and an FSDP one with a nested
``fsdp_config``), each as YAML and as JSON, are truncated, garbled with junk bytes (invalid
UTF-8, NUL bytes, brackets) at seeded offsets, given the wrong structure or wrongly typed
values, duplicated or unknown keys and YAML alias bombs; then come paths that are a directory,
missing, unreadable or empty. Each file goes through ``accel launch --config_file F --dry_run``
(and a few through the default config file). Every case must end either in success, where the
file really is valid, or in exit code 2 with a short message that names the file, says what is
wrong (the key and value where there is one) and how to fix it: never a traceback, a hang, a
started process or a written file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from accel_launch import launch as launch_module
from accel_launch.cli import main
from accel_state.torch_support import torch_has

pytestmark = pytest.mark.usefixtures("launch_environment")

SEED = 31
#: No case may take longer than this (the parser's own recursion limit takes about a second).
CASE_SECONDS = 10.0

MULTI_CPU_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

BASES: dict[str, str] = {
    "cpu.yaml": MULTI_CPU_YAML,
    "fsdp.yaml": FSDP_YAML,
    "cpu.json": json.dumps(yaml.safe_load(MULTI_CPU_YAML), indent=2) + "\n",
    "fsdp.json": json.dumps(yaml.safe_load(FSDP_YAML), indent=2) + "\n",
}
#: The richest valid file: FSDP's, except on the floor (torch 2.5), which refuses FSDP files
#: naming torch 2.6 (accel_state.torch_support); there the FSDP bases are left out.
RICH_YAML = FSDP_YAML
if not torch_has("fully_shard"):
    BASES = {name: text for name, text in BASES.items() if not name.startswith("fsdp")}
    RICH_YAML = MULTI_CPU_YAML

#: Junk written over a file's bytes; the first ones are not UTF-8, the next hold NUL bytes.
JUNK_NOT_UTF8 = (b"\xff\xfe", b"\xc3\x28", b"\xe2\x82", b"\x80\x80\x80")
JUNK_NUL = (b"\x00", b"\x00\x00\x00\x00", b"a\x00b")
JUNK_OTHER = (b"}{][", b"::", b"\t", b"\x1b[31m", b"&a *a", b"- ", b'"', b"\n  x\n")

#: (key, wrong value, what the message must say besides the path). A value of OK launches.
OK = "ok"
WRONG_VALUES: tuple[tuple[str, Any, tuple[str, ...] | str], ...] = (
    ("num_processes", "two", ("num_processes='two'", "is not an integer", "whole number")),
    ("num_processes", -1, OK),  # Accelerate's "not set": one process per GPU, 1 on the CPU
    ("num_processes", 1.5, ("num_processes=1.5", "is not an integer")),
    ("num_processes", 0, ("num_processes=0", ">= 1")),
    ("num_processes", None, ("num_processes=None", "is not an integer")),
    ("mixed_precision", 7, ("mixed_precision=7", "is not one of no, fp8, fp16, bf16")),
    ("mixed_precision", ["bf16"], ("mixed_precision=['bf16']", "is not one of")),
    ("distributed_type", "NOPE", ("distributed_type='NOPE'", "is not one of", "MULTI_CPU")),
    ("distributed_type", None, ("distributed_type is missing", "distributed_type: MULTI_GPU")),
    ("compute_environment", "CLOUD", ("compute_environment='CLOUD'", "LOCAL_MACHINE")),
    ("main_process_port", 70000, ("main_process_port=70000", "between 1 and 65535")),
    ("main_process_port", "http", ("main_process_port='http'", "is not an integer")),
    ("fsdp_config", [1, 2], ("fsdp_config must be a mapping", "[1, 2]", "indented under")),
    ("fsdp_config", "FULL_SHARD", ("fsdp_config must be a mapping", "'FULL_SHARD'")),
    ("deepspeed_config", 3, ("deepspeed_config must be a mapping", "3")),
    ("use_cpu", "sometimes", ("use_cpu='sometimes'", "is not a boolean", "true or false")),
    ("machine_rank", 3, ("machine_rank=3", "between 0 and num_machines - 1")),
    ("num_machines", "many", ("num_machines='many'", "is not an integer")),
    ("gpu_ids", [0, 1], ("gpu_ids=[0, 1]", "is not text", "'0,1'")),
    ("main_training_function", {"name": "main"}, ("main_training_function=", "is not text")),
    ("rdzv_backend", "carrier-pigeon", ("rdzv_backend='carrier-pigeon'", "static, c10d")),
    ("tpu_env", 5, ("tpu_env=5", "is not a list of text lines", "- line")),
    ("tpu_env", {"A": "1"}, ("tpu_env={'A': '1'}", "is not a list of text lines")),
    ("dynamo_config", [], ("dynamo_config must be a mapping", "[]")),
    ("invalid_key", "x", ("had unknown keys (['invalid_key'])", "remove them")),
    ("fp16", "sometimes", ("fp16='sometimes'", "is not a boolean")),
)

#: A YAML "billion laughs": nine levels of nine aliases, 9**9 strings once expanded.
LAUGHS = "lol0: &lol0 lol\n" + "".join(
    f"lol{level}: &lol{level} [{', '.join([f'*lol{level - 1}'] * 9)}]\n" for level in range(1, 10)
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One file handed to ``accel launch``.

    ``expect`` is ``"ok"`` (it must launch), ``"refused"`` (exit 2, the message holding each of
    ``fragments``) or ``"either"`` (random damage: launching is allowed only when the bytes
    still parse as a config mapping). ``content`` None leaves the path to ``setup``.
    """

    name: str
    content: bytes | None
    expect: str
    fragments: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    default_file: bool = False
    deny_read: bool = False


def _yaml_with(text: str, key: str, literal: str | None) -> str:
    """``text`` with the top-level ``key`` (and its indented lines) replaced by ``literal``."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            skipping = True
            continue
        if skipping and line.startswith((" ", "-")):
            continue
        skipping = False
        kept.append(line)
    if literal is not None:
        kept.append(f"{key}: {literal}")
    return "\n".join(kept) + "\n"


def _json_with(text: str, key: str, value: Any, drop: bool) -> str:
    data = json.loads(text)
    if drop:
        data.pop(key, None)
    else:
        data[key] = value
    return json.dumps(data, indent=2) + "\n"


def _wrong_value_cases() -> Iterator[Case]:
    for base, text in BASES.items():
        stem, suffix = base.split(".")
        for index, (key, value, outcome) in enumerate(WRONG_VALUES):
            name = f"value{index:02d}-{key}-{stem}.{suffix}"
            drop = value is None and key == "distributed_type"  # the key is left out
            if suffix == "yaml":
                content = _yaml_with(text, key, None if drop else json.dumps(value))
            else:
                content = _json_with(text, key, value, drop)
            if outcome == OK:
                yield Case(name, content.encode(), OK)
            else:
                yield Case(name, content.encode(), "refused", tuple(outcome))
    yield Case(
        "value-section-key-int.yaml",
        _yaml_with(MULTI_CPU_YAML, "deepspeed_config", "{1: 2}").encode(),
        "refused",
        ("deepspeed_config has the key 1", "not a name"),
    )
    yield Case(
        "value-commands-mapping.yaml",
        (MULTI_CPU_YAML + "commands:\n  a: 1\n").encode(),
        "refused",
        ("commands={'a': 1}", "is not a list of text lines"),
    )
    yield Case(
        "value-dynamo-backend-with-list-section.yaml",
        (MULTI_CPU_YAML + "dynamo_backend: INDUCTOR\ndynamo_config: [1, 2]\n").encode(),
        "refused",
        ("dynamo_config must be a mapping", "[1, 2]"),
    )


def _truncated_cases() -> Iterator[Case]:
    for base, text in BASES.items():
        data = text.encode()
        for label, cut in (
            ("0", 0),
            ("1", 1),
            ("third", len(data) // 3),
            ("half", len(data) // 2),
            ("all-but-last", len(data) - 1),
        ):
            content = data[:cut]
            if cut == 0:
                yield Case(f"cut-{label}-{base}", content, "refused", ("must hold a mapping",))
            elif base.endswith(".yaml") and cut == len(data) - 1:
                yield Case(f"cut-{label}-{base}", content, OK)  # only the last newline is gone
            else:
                yield Case(f"cut-{label}-{base}", content, "either")


def _garbled_cases(rng: random.Random) -> Iterator[Case]:
    junks = (*JUNK_NOT_UTF8, *JUNK_NUL, *JUNK_OTHER)
    for base, text in BASES.items():
        data = text.encode()
        offsets = {"start": 0, "middle": len(data) // 2, "end": len(data) - 2}
        for number in range(3):
            offsets[f"random{number}"] = rng.randrange(len(data))
        for where, offset in offsets.items():
            for junk in rng.sample(junks, 3):
                content = data[:offset] + junk + data[offset + len(junk) :]
                name = f"junk-{where}-{junk.hex()}-{base}"
                if junk in JUNK_NOT_UTF8:
                    yield Case(name, content, "refused", ("is not UTF-8 text", "line"))
                elif junk in JUNK_NUL:
                    yield Case(name, content, "refused", ("is not valid", "line"))
                else:
                    yield Case(name, content, "either")


def _structure_cases() -> Iterator[Case]:
    for suffix, values in (
        ("yaml", ("- a\n- b\n", "just text\n", "42\n", "null\n", "# only a comment\n")),
        ("json", ("[1, 2]", '"text"', "42", "null", "  \n")),
    ):
        for index, text in enumerate(values):
            yield Case(f"top{index}.{suffix}", text.encode(), "refused", ("must hold a mapping",))
    duplicate = ("gives the key 'num_processes' twice", "keep one")
    yield Case(
        "dup-top.yaml",
        (MULTI_CPU_YAML + "num_processes: 4\n").encode(),
        "refused",
        (*duplicate, "(lines 11 and 18)"),
    )
    yield Case(
        "dup-nested.yaml",
        FSDP_YAML.replace(
            "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_offload_params: true\n"
        ).encode(),
        "refused",
        ("gives the key 'fsdp_offload_params' twice", "(lines 10 and 16)"),
    )
    yield Case(
        "dup-top.json",
        BASES["cpu.json"].replace("{", '{\n  "num_processes": 4,', 1).encode(),
        "refused",
        duplicate,
    )
    # Accelerate 0.30 wrote `debug: false` twice in SageMaker files: one value, no ambiguity.
    yield Case("dup-same-value.yaml", (MULTI_CPU_YAML + "debug: false\n").encode(), OK)
    yield Case(
        "dup-same-value.json",
        BASES["cpu.json"].replace("{", '{\n  "num_processes": 2,', 1).encode(),
        OK,
    )
    yield Case(
        "dup-same-section.yaml",
        (FSDP_YAML + "fsdp_config:\n  fsdp_version: 2\n").encode(),
        "refused",
        ("gives the key 'fsdp_config' twice", "(lines 6 and 27)"),
    )
    yield Case("bom.yaml", b"\xef\xbb\xbf" + MULTI_CPU_YAML.encode(), OK)
    yield Case("bom.json", b"\xef\xbb\xbf" + BASES["cpu.json"].encode(), OK)
    tabbed = json.dumps(yaml.safe_load(RICH_YAML), indent="\t")  # not YAML, but valid JSON
    yield Case("tabs.json", tabbed.encode(), OK)
    flow = json.dumps(yaml.safe_load(RICH_YAML), indent=2)
    yield Case("flow.yaml", flow.encode(), OK)  # JSON is YAML too
    yield Case("yaml-named.json", MULTI_CPU_YAML.encode(), "refused", ("is not valid JSON",))
    marker = "/nonexistent-accel-fuzz-marker"
    yield Case(
        "python-tag.yaml",
        f"distributed_type: !!python/object/apply:os.system ['touch {marker}']\n".encode(),
        "refused",
        ("is not valid YAML", "line 1"),
    )
    bombs = {
        "bomb-unknown-key.yaml": LAUGHS + "distributed_type: MULTI_CPU\n",
        "bomb-commands.yaml": LAUGHS.replace("lol9:", "commands:")
        + "distributed_type: MULTI_CPU\n",
        "bomb-section.yaml": MULTI_CPU_YAML
        + "fsdp_config:\n"
        + "".join(f"  {line}\n" for line in LAUGHS.splitlines()),
    }
    for name, text in bombs.items():
        yield Case(name, text.encode(), "refused", ("more than 10000 values",))
    yield Case(
        "bomb-section-deep.yaml",
        (LAUGHS + "fsdp_config: {laughs: *lol9}\ndistributed_type: MULTI_CPU\n").encode(),
        "refused",
        ("more than 10000 values",),
    )
    yield Case(
        "alias-cycle.yaml",
        (MULTI_CPU_YAML + "fsdp_config: &self {inner: *self}\n").encode(),
        "refused",
        ("under the key 'fsdp_config' that contains itself",),
    )
    yield Case(
        "deep-20000.yaml",
        (MULTI_CPU_YAML + "fsdp_config: " + "[" * 20000 + "]" * 20000 + "\n").encode(),
        "refused",
        ("nests",),
    )
    yield Case(
        "deep-100.yaml",
        (MULTI_CPU_YAML + "fsdp_config: {a: " + "[" * 100 + "]" * 100 + "}\n").encode(),
        "refused",
        ("nests values more than 32 levels deep under the key 'fsdp_config'",),
    )
    yield Case(
        "deep.json",
        ('{"distributed_type": "MULTI_CPU", "x": ' + "[" * 100000 + "]" * 100000 + "}").encode(),
        "refused",
        ("nests",),
    )
    yield Case(
        "huge.yaml",
        (MULTI_CPU_YAML + "#" * (1 << 20)).encode(),
        "refused",
        ("larger than 1 MiB",),
    )


def _unreadable(path: Path) -> None:
    path.write_text(MULTI_CPU_YAML)
    path.chmod(0)


def _path_cases() -> Iterator[Case]:
    yield Case("a-directory", None, "refused", ("is a directory",), setup=Path.mkdir)
    yield Case("missing.yaml", None, "refused", ("does not exist",), setup=lambda path: None)
    yield Case("empty.yaml", b"", "refused", ("it is empty",))
    yield Case("empty.json", b"", "refused", ("it is empty",))
    if os.geteuid() != 0:  # root reads a chmod 000 file
        yield Case(
            "unreadable.yaml",
            None,
            "refused",
            ("cannot be read", "chmod u+r"),
            setup=_unreadable,
        )
    yield Case(
        "denied.yaml",
        MULTI_CPU_YAML.encode(),
        "refused",
        ("cannot be read (permission denied)", "chmod u+r"),
        deny_read=True,
    )
    yield Case("default-valid.yaml", RICH_YAML.encode(), OK, default_file=True)
    yield Case(
        "default-garbled.yaml",
        FSDP_YAML.encode().replace(b"fsdp_version", b"fsdp\xffversion"),
        "refused",
        ("is not UTF-8 text", "line 15, column 7"),
        default_file=True,
    )
    yield Case(
        "default-wrong.yaml",
        _yaml_with(MULTI_CPU_YAML, "num_processes", '"two"').encode(),
        "refused",
        ("num_processes='two'",),
        default_file=True,
    )


def build_cases() -> list[Case]:
    """Every case, in a fixed order: the same seed gives the same files."""
    rng = random.Random(SEED)
    cases = [Case(f"valid-{name}", text.encode(), OK) for name, text in BASES.items()]
    cases += [
        *_truncated_cases(),
        *_garbled_cases(rng),
        *_wrong_value_cases(),
        *_structure_cases(),
        *_path_cases(),
    ]
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def _parses_as_config(content: bytes, name: str) -> bool:
    """An independent look at damaged bytes: can they be a config mapping at all?"""
    try:
        text = content.decode("utf-8-sig")
        data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "distributed_type" in data


def _denying_open(denied: Path) -> Callable[..., Any]:
    """``Path.open`` that fails for ``denied`` as a file without read permission does."""
    opened = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == denied:
            raise PermissionError(13, "Permission denied", str(self))
        return opened(self, *args, **kwargs)

    return open_


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path.relative_to(root)): (path.lstat().st_size, path.lstat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
    }


def _check(case: Case, path: Path, code: Any, out: str, err: str, seconds: float) -> list[str]:
    """What is wrong with how ``case`` ended; empty when it ended well."""
    problems = []
    message = err.strip()
    if not isinstance(code, int):
        return [f"raised {code}"]
    if seconds > CASE_SECONDS:
        problems.append(f"took {seconds:.1f} s")
    if "Traceback" in err or "<unicode string>" in err:
        problems.append("printed a raw traceback or parser dump")
    if code == 0:
        if case.expect == "refused":
            problems.append("launched, but the file is not valid")
        elif case.expect == "either" and not _parses_as_config(case.content or b"", case.name):
            problems.append("launched a file that does not parse as a config")
        elif not out.strip():
            problems.append("a dry run printed no command")
    elif code == 2:
        if case.expect == OK:
            problems.append("refused a valid file")
        if str(path) not in message:
            problems.append(f"the message does not name the file {path}")
        if len(message.splitlines()) > 3:
            problems.append("the message is longer than 3 lines")
        problems += [
            f"the message lacks {part!r}" for part in case.fragments if part not in message
        ]
    else:
        problems.append(f"exit code {code}, expected 0 or 2")
    return problems


def test_every_config_file_launches_or_is_refused_clearly(
    tmp_path: Path,
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started: list[object] = []

    def record_start(*args: object) -> int:  # stands in for both ways a launch starts processes
        started.append(args)
        return 0

    monkeypatch.setattr(launch_module, "_run_direct", record_start)
    monkeypatch.setattr(launch_module, "_run_torchrun", record_start)
    cases = build_cases()
    folder = tmp_path / "cases"
    folder.mkdir()
    default = Path(os.environ["ACCEL_HOME"]) / "default_config.yaml"
    failures: list[str] = []
    outcomes = {0: 0, 2: 0}
    began = time.monotonic()
    for case in cases:
        path = default if case.default_file else folder / case.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if case.content is not None:
            path.write_bytes(case.content)
        if case.setup is not None:
            case.setup(path)
        argv = ["launch", "--dry_run", script]
        if not case.default_file:
            argv[1:1] = ["--config_file", str(path)]
        before = _snapshot(tmp_path)
        start = time.monotonic()
        with monkeypatch.context() as patch:
            if case.deny_read:
                patch.setattr(Path, "open", _denying_open(path))
            try:
                code: Any = main(argv)
            except Exception as error:  # noqa: BLE001 - a raw exception is what this hunts
                code = f"{type(error).__name__}: {error}"
        seconds = time.monotonic() - start
        captured = capsys.readouterr()
        problems = _check(case, path, code, captured.out, captured.err, seconds)
        if _snapshot(tmp_path) != before:
            problems.append("a file was written or changed")
        if started:
            problems.append("a process was started")
            started.clear()
        if isinstance(code, int):
            outcomes[code] = outcomes.get(code, 0) + 1
        if problems:
            failures.append(f"{case.name}: {'; '.join(problems)}\n    {captured.err.strip()}")
        if case.default_file:
            path.unlink()
        elif case.setup is _unreadable:
            path.chmod(0o600)
    assert not Path("/nonexistent-accel-fuzz-marker").exists()
    with capsys.disabled():
        print(
            f"\naccel launch config fuzz: {len(cases)} cases tried (seed {SEED}): "
            f"{outcomes[0]} launched, {outcomes[2]} refused with exit 2, "
            f"{len(failures)} ended badly, in {time.monotonic() - began:.1f} s"
        )
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
