"""The ACCEL_* environment contract and the environment helpers (parsers, context managers)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_state import (
    clear_environment,
    convert_dict_to_env_variables,
    environment,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accel_environment,
    str_to_bool,
)
from accel_state.testing.isolation import restored_variables

TRUE_SPELLINGS = ["y", "yes", "t", "true", "on", "1", "YES", "True", "On", " true "]
FALSE_SPELLINGS = ["n", "no", "f", "false", "off", "0", "NO", "False", "OFF", " 0 "]


@pytest.mark.parametrize("value", TRUE_SPELLINGS)
def test_str_to_bool_true_spellings(value: str) -> None:
    assert str_to_bool(value) == 1
    assert type(str_to_bool(value)) is int
    assert str_to_bool(value, to_bool=True) is True


@pytest.mark.parametrize("value", FALSE_SPELLINGS)
def test_str_to_bool_false_spellings(value: str) -> None:
    assert str_to_bool(value) == 0
    assert type(str_to_bool(value)) is int
    assert str_to_bool(value, to_bool=True) is False


@pytest.mark.parametrize("value", ["maybe", "", "2", "yess", "tru"])
def test_str_to_bool_rejects_other_values_naming_them(value: str) -> None:
    with pytest.raises(ValueError, match="invalid truth value") as info:
        str_to_bool(value)
    assert repr(value) in str(info.value)


def test_parse_flag_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_TEST_FLAG", raising=False)
    assert parse_flag_from_env("ACCEL_TEST_FLAG") is False
    assert parse_flag_from_env("ACCEL_TEST_FLAG", default=True) is True
    monkeypatch.setenv("ACCEL_TEST_FLAG", "")
    assert parse_flag_from_env("ACCEL_TEST_FLAG", default=True) is True
    monkeypatch.setenv("ACCEL_TEST_FLAG", "yes")
    assert parse_flag_from_env("ACCEL_TEST_FLAG") is True
    monkeypatch.setenv("ACCEL_TEST_FLAG", "0")
    assert parse_flag_from_env("ACCEL_TEST_FLAG", default=True) is False


def test_parse_flag_from_env_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_TEST_FLAG", "perhaps")
    with pytest.raises(ValueError, match="ACCEL_TEST_FLAG") as info:
        parse_flag_from_env("ACCEL_TEST_FLAG")
    assert "'perhaps'" in str(info.value)


def test_parse_choice_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_TEST_CHOICE", raising=False)
    assert parse_choice_from_env("ACCEL_TEST_CHOICE") == "no"
    assert parse_choice_from_env("ACCEL_TEST_CHOICE", "bf16") == "bf16"
    monkeypatch.setenv("ACCEL_TEST_CHOICE", "fp16")
    assert parse_choice_from_env("ACCEL_TEST_CHOICE", "bf16") == "fp16"


def test_get_int_from_env_first_non_negative_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("ACCEL_T_A", "ACCEL_T_B", "ACCEL_T_C"):
        monkeypatch.delenv(key, raising=False)
    assert get_int_from_env(["ACCEL_T_A", "ACCEL_T_B"], 7) == 7
    monkeypatch.setenv("ACCEL_T_B", "3")
    assert get_int_from_env(["ACCEL_T_A", "ACCEL_T_B"], 7) == 3
    monkeypatch.setenv("ACCEL_T_A", "-1")  # negative values are skipped
    assert get_int_from_env(["ACCEL_T_A", "ACCEL_T_B"], 7) == 3
    monkeypatch.setenv("ACCEL_T_A", "0")
    assert get_int_from_env(("ACCEL_T_A", "ACCEL_T_B"), 7) == 0
    monkeypatch.setenv("ACCEL_T_C", "  ")  # blank means unset
    assert get_int_from_env(["ACCEL_T_C"], 5) == 5


def test_get_int_from_env_bad_integer_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_T_A", "two")
    with pytest.raises(ValueError, match="ACCEL_T_A") as info:
        get_int_from_env(["ACCEL_T_A"], 1)
    assert "'two'" in str(info.value)


# The variables the tests below write directly, as the code under test does.
_SCRATCH = (
    "ACCEL_T_EXISTING",
    "ACCEL_T_NEW",
    "ACCEL_T_KEEP",
    "ACCEL_T_INSIDE",
    "ACCEL_T_CHANGED",
    "ACCEL_T_DELETED",
    "ACCEL_T_CREATED",
    "OTHER_T_CREATED",
)


@pytest.fixture(autouse=True)
def _scratch_variables() -> Iterator[None]:
    """What the tests do to ``_SCRATCH`` is undone after each."""
    with restored_variables(*_SCRATCH):
        yield


def test_patch_environment_sets_upper_cased_string_values_and_restores() -> None:
    os.environ["ACCEL_T_EXISTING"] = "old"
    os.environ.pop("ACCEL_T_NEW", None)
    with patch_environment(accel_t_existing="new", ACCEL_T_NEW=3):
        assert os.environ["ACCEL_T_EXISTING"] == "new"
        assert os.environ["ACCEL_T_NEW"] == "3"
        assert "accel_t_existing" not in os.environ
    assert os.environ["ACCEL_T_EXISTING"] == "old"
    assert "ACCEL_T_NEW" not in os.environ


def test_patch_environment_restores_on_exception() -> None:
    os.environ["ACCEL_T_EXISTING"] = "old"
    os.environ.pop("ACCEL_T_NEW", None)
    with pytest.raises(RuntimeError, match="boom"):
        with patch_environment(ACCEL_T_EXISTING="new", ACCEL_T_NEW="x"):
            raise RuntimeError("boom")
    assert os.environ["ACCEL_T_EXISTING"] == "old"
    assert "ACCEL_T_NEW" not in os.environ


def test_patch_environment_restores_a_value_changed_inside_the_block() -> None:
    os.environ.pop("ACCEL_T_NEW", None)
    with patch_environment(ACCEL_T_NEW="1"):
        os.environ["ACCEL_T_NEW"] = "changed"
    assert "ACCEL_T_NEW" not in os.environ


def test_clear_environment_empties_and_restores_the_same_object() -> None:
    original = os.environ
    os.environ["ACCEL_T_KEEP"] = "kept"
    before = dict(os.environ)
    with clear_environment():
        assert os.environ is original
        assert dict(os.environ) == {}
        os.environ["ACCEL_T_INSIDE"] = "1"
    assert os.environ is original
    assert dict(os.environ) == before
    assert "ACCEL_T_INSIDE" not in os.environ


def test_clear_environment_restores_on_exception() -> None:
    os.environ["ACCEL_T_KEEP"] = "kept"
    before = dict(os.environ)
    with pytest.raises(KeyError):
        with clear_environment():
            os.environ["ACCEL_T_INSIDE"] = "1"
            raise KeyError("x")
    assert dict(os.environ) == before


def test_purge_accel_environment_on_a_function() -> None:
    os.environ["ACCEL_T_CHANGED"] = "before"
    os.environ["ACCEL_T_DELETED"] = "present"
    os.environ.pop("ACCEL_T_CREATED", None)
    os.environ.pop("OTHER_T_CREATED", None)

    @purge_accel_environment
    def body(value: int) -> int:
        """Docstring kept."""
        os.environ["ACCEL_T_CREATED"] = "1"
        os.environ["ACCEL_T_CHANGED"] = "after"
        del os.environ["ACCEL_T_DELETED"]
        os.environ["OTHER_T_CREATED"] = "1"
        return value * 2

    assert body.__name__ == "body"
    assert body.__doc__ == "Docstring kept."
    assert body(21) == 42
    assert "ACCEL_T_CREATED" not in os.environ
    assert os.environ["ACCEL_T_CHANGED"] == "before"
    assert os.environ["ACCEL_T_DELETED"] == "present"
    # Only ACCEL_* variables are purged.
    assert os.environ["OTHER_T_CREATED"] == "1"


def test_purge_accel_environment_cleans_up_after_an_exception() -> None:
    os.environ.pop("ACCEL_T_CREATED", None)

    @purge_accel_environment
    def body() -> None:
        os.environ["ACCEL_T_CREATED"] = "1"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    assert "ACCEL_T_CREATED" not in os.environ


def test_purge_accel_environment_on_a_class_wraps_test_methods() -> None:
    os.environ.pop("ACCEL_T_CREATED", None)

    @purge_accel_environment
    class Case:
        def test_sets(self) -> str:
            os.environ["ACCEL_T_CREATED"] = "1"
            return "ran"

        def helper(self) -> None:
            os.environ["ACCEL_T_CREATED"] = "helper"

    case = Case()
    assert case.test_sets() == "ran"
    assert "ACCEL_T_CREATED" not in os.environ
    case.helper()  # not a test method: not wrapped
    assert os.environ["ACCEL_T_CREATED"] == "helper"


def test_convert_dict_to_env_variables() -> None:
    lines = convert_dict_to_env_variables({"ACCEL_A": "1", "ACCEL_B": 2, "PATH_X": "/a:/b"})
    assert lines == ["ACCEL_A=1\n", "ACCEL_B=2\n", "PATH_X=/a:/b\n"]


@pytest.mark.parametrize(
    "entry",
    [{"BAD": "a;rm -rf"}, {"BAD": "a\nb"}, {"B;AD": "x"}, {"BA\nD": "x"}, {"BAD": ""}],
)
def test_convert_dict_to_env_variables_skips_unsafe_entries_with_a_warning(
    entry: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Logged as Accelerate logs it (its tests read the log of accelerate.utils.environment).
    with caplog.at_level("WARNING", logger="accel.utils.environment"):
        lines = convert_dict_to_env_variables({"GOOD": "ok", **entry})
    assert lines == ["GOOD=ok\n"]
    (record,) = caplog.records
    assert record.name == "accel.utils.environment" and record.levelname == "WARNING"
    assert record.getMessage().startswith("Skipping ")


def test_contract_names_are_the_constants() -> None:
    names = [name for name in environment.__all__ if name.isupper() and name != "CONTRACT"]
    assert names, "no constants exported"
    for name in names:
        assert getattr(environment, name) == name
        assert name in environment.CONTRACT, f"{name} is exported but not in CONTRACT"
    for name, meaning in environment.CONTRACT.items():
        assert (
            name.startswith(("ACCEL_", "FSDP_", "PARALLELISM_CONFIG_")) or name == "FORK_LAUNCHED"
        )
        assert meaning.strip(), f"{name} has no description"


def _repo_root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "packages").is_dir():
            return folder
    raise AssertionError(f"no folder above {__file__} contains packages/")


def test_every_contract_variable_is_documented() -> None:
    doc = _repo_root() / "docs" / "environment.md"
    assert doc.is_file(), f"{doc} is missing: it must document every ACCEL_* variable"
    text = doc.read_text(encoding="utf-8")
    documented = set(re.findall(r"\b(?:ACCEL|FSDP)_[A-Z0-9_]+\b", text))
    missing = sorted(
        name
        for name in environment.CONTRACT
        if name.startswith(("ACCEL_", "FSDP_")) and name not in documented
    )
    assert not missing, f"docs/environment.md does not mention {missing}"


def test_accelerate_variables_are_named_with_their_accel_names() -> None:
    environ = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_DOWNCAST_BF16": "yes",  # accel's name: ACCEL_DOWNCAST_BF16
        "ACCELERATE_TPU_NAME": "pod",  # no such setting in accel
        "ACCELERATE_USE_FSDP": "true",
        "ACCEL_MIXED_PRECISION": "bf16",
    }
    assert environment.accelerate_variables(environ) == {
        "ACCELERATE_DOWNCAST_BF16": "ACCEL_DOWNCAST_BF16",
        "ACCELERATE_TPU_NAME": None,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "ACCEL_GRADIENT_ACCUMULATION_STEPS",
        "ACCELERATE_MIXED_PRECISION": "ACCEL_MIXED_PRECISION",
        "ACCELERATE_USE_FSDP": "ACCEL_USE_FSDP",
    }


@pytest.mark.parametrize(
    ("name", "environ", "expected"),
    [
        (
            "ACCEL_MIXED_PRECISION",
            {"ACCELERATE_MIXED_PRECISION": "bf16"},
            ("ACCELERATE_MIXED_PRECISION", "bf16"),
        ),
        (
            "ACCEL_MIXED_PRECISION",
            {"ACCEL_MIXED_PRECISION": "fp16"},
            ("ACCEL_MIXED_PRECISION", "fp16"),
        ),
        # the same setting twice: accel's spelling is the one named
        (
            "ACCEL_MIXED_PRECISION",
            {"ACCEL_MIXED_PRECISION": "bf16", "ACCELERATE_MIXED_PRECISION": "BF16"},
            ("ACCEL_MIXED_PRECISION", "bf16"),
        ),
        (
            "ACCEL_USE_CPU",
            {"ACCEL_USE_CPU": "1", "ACCELERATE_USE_CPU": "true"},
            ("ACCEL_USE_CPU", "1"),
        ),
        # empty counts as unset
        (
            "ACCEL_DEBUG_MODE",
            {"ACCEL_DEBUG_MODE": "", "ACCELERATE_DEBUG_MODE": "1"},
            ("ACCELERATE_DEBUG_MODE", "1"),
        ),
        ("ACCEL_DEBUG_MODE", {}, None),
    ],
)
def test_lookup_reads_accelerates_spelling_too(
    name: str, environ: dict[str, str], expected: tuple[str, str] | None
) -> None:
    assert environment.lookup_variable(name, environ) == expected


def test_disagreeing_spellings_are_an_error_naming_both() -> None:
    environ = {"ACCEL_MIXED_PRECISION": "fp16", "ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.raises(ValueError) as raised:
        environment.read_variable("ACCEL_MIXED_PRECISION", environ)
    message = str(raised.value)
    assert "ACCEL_MIXED_PRECISION='fp16'" in message
    assert "ACCELERATE_MIXED_PRECISION='bf16'" in message


def test_helpers_read_accelerates_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "yes")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    assert environment.parse_flag_from_env("ACCEL_DEBUG_MODE") is True
    assert environment.get_int_from_env(["ACCEL_GRADIENT_ACCUMULATION_STEPS"], 1) == 4
    assert environment.parse_choice_from_env("ACCEL_DYNAMO_MODE") == "max-autotune"
    # names outside the contract are read as they are
    monkeypatch.setenv("ACCELERATE_NOT_A_SETTING", "1")
    assert environment.read_variable("ACCEL_NOT_A_SETTING") is None


def test_accelerate_variables_warn_once_per_unknown_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(environment, "_warned_accelerate_variables", set())
    environ = {"ACCELERATE_TPU_NAME": "pod", "ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.warns(UserWarning) as caught:
        environment.warn_accelerate_variables(environ)
        environment.warn_accelerate_variables(environ)  # already said: silent
    (warning,) = caught
    assert "ACCELERATE_TPU_NAME" in str(warning.message)
    assert "MIXED_PRECISION" not in str(warning.message)  # read as ACCEL_MIXED_PRECISION


def test_partial_state_warns_about_a_job_scripts_accelerate_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accel_state import PartialState

    monkeypatch.setattr(environment, "_warned_accelerate_variables", set())
    monkeypatch.setenv("ACCELERATE_TPU_ZONE", "us-central1-a")
    PartialState._reset_state()
    with pytest.warns(UserWarning, match="ACCELERATE_TPU_ZONE"):
        PartialState()
