"""PartialState, AcceleratorState and GradientState in one process.

Multi-process logic (splitting, decorators, ordering) is checked by setting the shared
state by hand: the Borg dict is updated after a single-process ``PartialState()``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from accel_state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    PartialState,
    is_initialized,
    process_group,
    wait_for_everyone,
)
from accel_state import partial_state as partial_state_module
from accel_state.engine_requests import EngineUnavailableError

STATE_VARIABLES = (
    "ACCEL_TORCH_DEVICE",
    "ACCEL_USE_CPU",
    "ACCEL_MIXED_PRECISION",
    "ACCEL_USE_DEEPSPEED",
    "ACCEL_USE_FSDP",
    "ACCEL_USE_MEGATRON_LM",
    "ACCEL_USE_PARALLELISM_CONFIG",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_MEGATRON_LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG",
    "ACCEL_DEBUG_MODE",
    "FORK_LAUNCHED",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


@pytest.fixture(autouse=True)
def _single_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in STATE_VARIABLES:
        monkeypatch.delenv(key, raising=False)


def hand_set(
    num_processes: int,
    process_index: int,
    local_process_index: int | None = None,
    distributed_type: DistributedType = DistributedType.MULTI_CPU,
) -> PartialState:
    """Pretend to be one rank of a multi-process run (no process group is created)."""
    state = PartialState()
    PartialState._shared_state.update(
        num_processes=num_processes,
        process_index=process_index,
        local_process_index=process_index if local_process_index is None else local_process_index,
        distributed_type=distributed_type,
    )
    return state


# --------------------------------------------------------------------------------------------
# PartialState
# --------------------------------------------------------------------------------------------


def test_partial_state_is_a_borg() -> None:
    first = PartialState()
    second = PartialState()
    assert first is not second
    assert first.__dict__ is second.__dict__ is PartialState._shared_state
    first.__dict__["extra"] = 1
    assert second.extra == 1  # type: ignore[attr-defined]


def test_single_process_defaults() -> None:
    state = PartialState()
    assert state.initialized
    assert state.distributed_type == DistributedType.NO
    assert state.num_processes == 1
    assert state.process_index == 0
    assert state.local_process_index == 0
    assert state.backend is None
    assert state.device == torch.device("cpu")
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.use_distributed is False
    assert state.debug is False and state.fork_launched is False
    assert state.topology.source == "none"
    assert not dist.is_initialized()
    # As in Accelerate 1.15, where str(DistributedType.NO) is "DistributedType.NO".
    assert repr(state).startswith("Distributed environment: DistributedType.NO\nNum processes: 1\n")


def test_later_arguments_do_not_change_an_initialised_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    PartialState()
    monkeypatch.setenv("ACCEL_TORCH_DEVICE", "meta")
    assert PartialState(cpu=True).device == torch.device("cpu")


def _prefer_another_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the default device something other than the CPU ("meta" stands in for a GPU)."""
    monkeypatch.setattr(partial_state_module, "default_device_type", lambda: "meta")
    assert PartialState().device.type == "meta"  # the control: without cpu, not the CPU
    PartialState._reset_state()


def test_cpu_true_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _prefer_another_device(monkeypatch)
    state = PartialState(cpu=True)
    assert state.device == torch.device("cpu")
    assert state.distributed_type == DistributedType.NO


def test_accel_use_cpu_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    _prefer_another_device(monkeypatch)
    monkeypatch.setenv("ACCEL_USE_CPU", "yes")
    assert PartialState().device.type == "cpu"


def test_debug_and_fork_launched_flags_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DEBUG_MODE", "1")
    monkeypatch.setenv("FORK_LAUNCHED", "true")
    state = PartialState()
    assert state.debug is True
    assert state.fork_launched is True


def test_fork_launched_leaves_the_default_group_to_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(process_group, "destroy_process_group", calls.append)
    state = PartialState()
    state.destroy_process_group()
    assert calls == [None]
    state.__dict__["fork_launched"] = True
    state.destroy_process_group()
    assert calls == [None]
    group = object()
    state.destroy_process_group(group)
    assert calls == [None, group]


def test_torch_device_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_TORCH_DEVICE", "meta")
    state = PartialState()
    assert state.device == torch.device("meta")
    assert state.distributed_type == DistributedType.NO


def test_bad_torch_device_names_the_variable_and_leaves_no_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_TORCH_DEVICE", "warp-drive:0")
    with pytest.raises(ValueError, match="ACCEL_TORCH_DEVICE") as info:
        PartialState()
    assert "'warp-drive:0'" in str(info.value)
    assert PartialState._shared_state == {}
    monkeypatch.delenv("ACCEL_TORCH_DEVICE")
    assert PartialState().device == torch.device("cpu")


def test_failure_late_in_setup_leaves_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("init failed")

    # Two processes per the environment, but joining the group fails.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(process_group, "init_process_group", explode)
    with pytest.raises(RuntimeError, match="init failed"):
        PartialState(cpu=True)
    assert PartialState._shared_state == {}


def test_known_attribute_after_reset_explains_the_reset() -> None:
    state = PartialState()
    PartialState._reset_state()
    assert PartialState._shared_state == {}
    assert not state.initialized
    with pytest.raises(AttributeError) as info:
        _ = state.device
    message = str(info.value)
    assert "`PartialState` object has no attribute" in message
    assert "This happens if `PartialState._reset_state()`" in message


def test_unknown_attribute_gives_the_plain_message() -> None:
    state = PartialState()
    with pytest.raises(AttributeError) as info:
        _ = state.not_an_attribute  # type: ignore[attr-defined]
    assert str(info.value) == "'PartialState' object has no attribute 'not_an_attribute'"
    PartialState._reset_state()
    with pytest.raises(AttributeError) as info:
        _ = state.not_an_attribute  # type: ignore[attr-defined]
    assert "_reset_state" not in str(info.value)


def test_reset_then_recreate() -> None:
    state = PartialState()
    PartialState._reset_state()
    again = PartialState()
    assert again.num_processes == 1
    assert state.num_processes == 1  # the old instance sees the new state


def test_rank_predicates_with_hand_set_state() -> None:
    state = hand_set(num_processes=4, process_index=3, local_process_index=1)
    assert state.use_distributed
    assert not state.is_main_process
    assert not state.is_local_main_process
    assert state.is_last_process
    hand_set(num_processes=4, process_index=2, local_process_index=0)
    assert state.is_local_main_process and not state.is_main_process and not state.is_last_process
    # Megatron-LM: the main process is the last one.
    hand_set(4, 3, 1, DistributedType.MEGATRON_LM)
    assert state.is_main_process and state.is_local_main_process
    # Several processes but not distributed: not "use_distributed".
    hand_set(4, 0, 0, DistributedType.NO)
    assert not state.use_distributed
    hand_set(1, 0, 0, DistributedType.MULTI_CPU)
    assert not state.use_distributed


def test_wait_for_everyone_is_a_no_op_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    PartialState().wait_for_everyone()
    wait_for_everyone()
    assert calls == []
    hand_set(2, 0)
    wait_for_everyone()
    assert calls == ["barrier"]


@pytest.mark.parametrize(
    ("rank", "local_rank", "manager", "expected"),
    [
        (0, 0, "main_process_first", ["block", "barrier"]),
        (1, 1, "main_process_first", ["barrier", "block"]),
        (2, 0, "local_main_process_first", ["block", "barrier"]),
        (2, 1, "local_main_process_first", ["barrier", "block"]),
    ],
)
def test_main_process_first_orders_the_barrier(
    monkeypatch: pytest.MonkeyPatch, rank: int, local_rank: int, manager: str, expected: list[str]
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    state = hand_set(4, rank, local_rank)
    with getattr(state, manager)():
        calls.append("block")
    assert calls == expected


def test_main_process_first_without_distribution_just_runs() -> None:
    calls: list[str] = []
    state = PartialState()
    with state.main_process_first():
        calls.append("block")
    with state.local_main_process_first():
        calls.append("local")
    assert calls == ["block", "local"]


# --------------------------------------------------------------------------------------------
# split_between_processes
# --------------------------------------------------------------------------------------------


def _split(num_processes: int, rank: int, inputs: Any, apply_padding: bool = False) -> Any:
    state = hand_set(num_processes, rank)
    with state.split_between_processes(inputs, apply_padding=apply_padding) as part:
        return part


def test_split_one_process_yields_the_input_unchanged() -> None:
    inputs = ["A", "B", "C"]
    with PartialState().split_between_processes(inputs, apply_padding=True) as part:
        assert part is inputs


@pytest.mark.parametrize(
    ("rank", "expected", "padded"),
    [(0, ["A", "B"], ["A", "B"]), (1, ["C"], ["C", "C"])],
)
def test_split_list_on_two_processes(rank: int, expected: list[str], padded: list[str]) -> None:
    assert _split(2, rank, ["A", "B", "C"]) == expected
    assert _split(2, rank, ["A", "B", "C"], apply_padding=True) == padded


def test_split_tuple_keeps_the_type() -> None:
    assert _split(2, 0, ("A", "B", "C")) == ("A", "B")
    assert _split(2, 1, ("A", "B", "C"), apply_padding=True) == ("C", "C")


@pytest.mark.parametrize(("rank", "expected"), [(0, [0, 1, 2]), (1, [3, 4, 4])])
def test_split_tensor_padded(rank: int, expected: list[int]) -> None:
    assert _split(2, rank, torch.arange(5), apply_padding=True).tolist() == expected
    unpadded = _split(2, rank, torch.arange(5))
    assert unpadded.tolist() == expected[: 3 - rank]


def test_split_two_dimensional_tensor_pads_with_the_last_row() -> None:
    data = torch.arange(10).reshape(5, 2)
    assert _split(2, 1, data, apply_padding=True).tolist() == [[6, 7], [8, 9], [8, 9]]


def test_split_more_processes_than_items() -> None:
    items = ["A", "B"]
    assert [_split(3, rank, items) for rank in range(3)] == [["A"], ["B"], ["B"]]
    assert [_split(3, rank, items, apply_padding=True) for rank in range(3)] == [
        ["A"],
        ["B"],
        ["B"],
    ]


def test_split_seven_items_on_three_processes_is_contiguous() -> None:
    items = list(range(7))
    parts = [_split(3, rank, items) for rank in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [_split(3, rank, items, apply_padding=True) for rank in range(3)]
    assert padded == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]


def test_split_dict_splits_every_value_alike() -> None:
    inputs = {"text": ["a", "b", "c"], "ids": torch.tensor([10, 11, 12])}
    part = _split(2, 1, inputs, apply_padding=True)
    assert part["text"] == ["c", "c"]
    assert part["ids"].tolist() == [12, 12]
    assert inputs["text"] == ["a", "b", "c"]  # the input is not modified
    first = _split(2, 0, inputs)
    assert first["text"] == ["a", "b"] and first["ids"].tolist() == [10, 11]


def test_split_dict_with_unequal_lengths_names_the_keys() -> None:
    with pytest.raises(ValueError, match="same length") as info:
        _split(2, 0, {"short": [1], "long": [1, 2, 3]})
    assert "'short'" in str(info.value) and "'long'" in str(info.value)


class FakeDataset:
    """Looks like a ``datasets.Dataset``: has ``__len__`` and ``select``."""

    def __init__(self, rows: list[str]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, indices: Any) -> list[str]:
        return [self.rows[i] for i in indices]


def test_split_dataset_like_object_uses_select() -> None:
    data = FakeDataset(["A", "B", "C", "D", "E"])
    assert _split(2, 0, data) == ["A", "B", "C"]
    assert _split(2, 1, data) == ["D", "E"]
    assert _split(2, 1, data, apply_padding=True) == ["D", "E", "E"]
    two = FakeDataset(["A", "B"])
    assert [_split(3, rank, two) for rank in range(3)] == [["A"], ["B"], ["B"]]


def test_split_other_sized_objects_are_yielded_unchanged() -> None:
    text = "ABCDE"
    assert _split(2, 1, text) is text
    values = {3, 1, 2}
    assert _split(2, 0, values) is values


# --------------------------------------------------------------------------------------------
# on_* decorators and print
# --------------------------------------------------------------------------------------------


def _runs(decorated: Callable[[], Any]) -> bool:
    return decorated() == "ran"


def _task() -> str:
    return "ran"


@pytest.mark.parametrize(
    ("rank", "local_rank", "main", "local_main", "last"),
    [
        (0, 0, True, True, False),
        (1, 1, False, False, False),
        (2, 0, False, True, True),
    ],
)
def test_on_process_decorators_with_hand_set_ranks(
    rank: int, local_rank: int, main: bool, local_main: bool, last: bool
) -> None:
    state = hand_set(3, rank, local_rank)
    assert _runs(state.on_main_process(_task)) is main
    assert _runs(state.on_local_main_process(_task)) is local_main
    assert _runs(state.on_last_process(_task)) is last
    for index in range(3):
        assert _runs(state.on_process(_task, process_index=index)) is (index == rank)
        assert _runs(state.on_process(process_index=index)(_task)) is (index == rank)
    for index in range(2):
        assert _runs(state.on_local_process(local_process_index=index)(_task)) is (
            index == local_rank
        )


def test_skipped_function_is_not_called() -> None:
    called: list[int] = []
    state = hand_set(2, 1)

    @state.on_main_process
    def record() -> None:
        called.append(1)

    assert record() is None
    assert called == []


def test_decorators_run_everything_when_not_distributed() -> None:
    state = PartialState()
    assert state.on_main_process(_task) is _task
    assert state.on_process(_task, process_index=5) is _task
    assert state.on_local_process(_task, local_process_index=5) is _task
    assert state.on_last_process(_task) is _task


def test_on_main_process_before_initialisation_is_refused() -> None:
    state = PartialState()
    PartialState._reset_state()
    with pytest.raises(ValueError, match="must be initialized"):
        state.on_main_process(_task)


@pytest.mark.parametrize(("local_rank", "printed"), [(0, "hello 1\n"), (1, "")])
def test_print_only_on_the_local_main_process(
    capsys: pytest.CaptureFixture[str], local_rank: int, printed: str
) -> None:
    state = hand_set(4, 3, local_rank)
    state.print("hello", 1)
    assert capsys.readouterr().out == printed


# --------------------------------------------------------------------------------------------
# AcceleratorState
# --------------------------------------------------------------------------------------------


def test_is_initialized_tracks_accelerator_state() -> None:
    assert not is_initialized()
    PartialState()
    assert not is_initialized()
    AcceleratorState()
    assert is_initialized()
    AcceleratorState._reset_state()
    assert not is_initialized()


def test_accelerator_state_copies_partial_state() -> None:
    accel = AcceleratorState()
    partial = PartialState()
    assert accel.__dict__ is AcceleratorState._shared_state
    assert AcceleratorState._shared_state is not PartialState._shared_state
    for key, value in PartialState._shared_state.items():
        assert AcceleratorState._shared_state[key] == value
    assert accel.device == partial.device
    assert accel.distributed_type == DistributedType.NO
    assert accel.initialized
    assert accel.mixed_precision == "no"
    assert "Mixed precision type: no" in repr(accel)


def test_accelerator_state_reuses_an_existing_partial_state() -> None:
    hand_set(2, 1)
    accel = AcceleratorState()
    assert accel.num_processes == 2
    assert accel.process_index == 1
    assert not accel.is_main_process


def test_mixed_precision_from_argument_is_lower_cased() -> None:
    assert AcceleratorState(mixed_precision="BF16").mixed_precision == "bf16"


def test_mixed_precision_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    assert AcceleratorState().mixed_precision == "fp16"


def test_mixed_precision_argument_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    assert AcceleratorState(mixed_precision="no").mixed_precision == "no"


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_invalid_mixed_precision_lists_the_choices(
    monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    if source == "argument":
        with pytest.raises(ValueError, match="mixed_precision='fp32'") as info:
            AcceleratorState(mixed_precision="fp32")
    else:
        monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp32")
        with pytest.raises(ValueError, match="ACCEL_MIXED_PRECISION='fp32'") as info:
            AcceleratorState()
    assert "no, fp8, fp16, bf16" in str(info.value)
    assert AcceleratorState._shared_state == {}


def test_recreating_with_another_precision_is_refused() -> None:
    AcceleratorState(mixed_precision="bf16")
    AcceleratorState(mixed_precision="bf16")  # the same precision is fine
    AcceleratorState()  # so is not asking
    with pytest.raises(ValueError) as info:
        AcceleratorState(mixed_precision="fp16")
    assert "AcceleratorState has already been initialized and cannot be changed" in str(info.value)
    assert "mixed_precision='fp16'" in str(info.value)
    assert AcceleratorState().mixed_precision == "bf16"


def test_recreating_with_cpu_on_another_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_TORCH_DEVICE", "meta")
    AcceleratorState()
    with pytest.raises(ValueError, match="already been initialized") as info:
        AcceleratorState(cpu=True)
    assert "cpu=True" in str(info.value)


def test_recreating_with_cpu_on_cpu_is_fine() -> None:
    AcceleratorState()
    assert AcceleratorState(cpu=True).device == torch.device("cpu")


def test_reset_accelerator_state_only_or_both() -> None:
    AcceleratorState()
    AcceleratorState._reset_state()
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state != {}
    AcceleratorState()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state == {}


def test_accelerator_state_known_attribute_after_reset() -> None:
    accel = AcceleratorState()
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as info:
        _ = accel.fsdp_plugin
    assert "`AcceleratorState` object has no attribute `fsdp_plugin`" in str(info.value)
    assert "This happens if `AcceleratorState._reset_state()`" in str(info.value)
    with pytest.raises(AttributeError) as info:
        _ = accel.unknown_thing  # type: ignore[attr-defined]
    assert str(info.value) == "'AcceleratorState' object has no attribute 'unknown_thing'"


ENGINE_ARGUMENTS = [("megatron_lm_plugin", "Megatron-LM")]


@pytest.mark.parametrize(("argument", "engine"), ENGINE_ARGUMENTS)
@pytest.mark.parametrize("world", [1, 2])
def test_engine_plugins_are_refused_before_any_state_exists(
    argument: str, engine: str, world: int
) -> None:
    if world > 1:
        hand_set(world, 0)
    with pytest.raises(EngineUnavailableError) as info:
        AcceleratorState(**{argument: object()})
    message = str(info.value)
    assert message.startswith(engine)
    assert f"requested by AcceleratorState({argument}=...)" in message
    assert f"Remove {argument} from AcceleratorState(...)" in message
    assert "nothing was started" in message
    assert isinstance(info.value, NotImplementedError)
    assert AcceleratorState._shared_state == {}


def test_a_parallelism_config_and_the_old_tensor_parallel_plugin_are_kept() -> None:
    config = object()
    state = AcceleratorState(parallelism_config=config)
    assert state.parallelism_config is config and state.device_mesh is None
    AcceleratorState._reset_state(reset_partial_state=True)

    class OldPlugin:
        tp_size = 2

    plugin = OldPlugin()  # the Accelerator turns it into ParallelismConfig(tp_size=2)
    assert AcceleratorState(torch_tp_plugin=plugin).torch_tp_plugin is plugin
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_accelerator_is_named_as_the_source() -> None:
    with pytest.raises(EngineUnavailableError, match=r"Accelerator\(megatron_lm_plugin=\.\.\.\)"):
        AcceleratorState(megatron_lm_plugin=object(), _from_accelerator=True)


class _Plugin:
    """What the state needs of a DeepSpeed plugin to select it."""

    def __init__(self) -> None:
        self.selected = False

    def select(self, _from_accelerator_state: bool = False) -> None:
        assert _from_accelerator_state
        self.selected = True

    def _unselect(self) -> None:
        self.selected = False


def test_several_deepspeed_plugins_are_selected_by_name() -> None:
    a, b = _Plugin(), _Plugin()
    state = AcceleratorState(deepspeed_plugin={"a": a, "b": b})
    assert state.deepspeed_plugin is a and (a.selected, b.selected) == (True, False)
    state.select_deepspeed_plugin("b")
    assert state.deepspeed_plugin is b and (a.selected, b.selected) == (False, True)
    assert state.get_deepspeed_plugin("a") is a
    with pytest.raises(
        ValueError, match=r"'c' is not a DeepSpeed plugin of this run.*\['a', 'b'\]"
    ):
        state.select_deepspeed_plugin("c")


@pytest.mark.parametrize(
    ("plugins", "match"),
    [({}, "holds no plugin"), ({1: _Plugin()}, "names must be non-empty strings, got \\[1\\]")],
)
def test_bad_deepspeed_plugin_mappings_are_refused(plugins: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AcceleratorState(deepspeed_plugin=plugins)
    assert not AcceleratorState._shared_state


def test_selecting_a_plugin_without_deepspeed_plugins_says_how() -> None:
    state = AcceleratorState()
    with pytest.raises(ValueError, match="has no DeepSpeed plugins: pass Accelerator"):
        state.select_deepspeed_plugin("a")


@pytest.mark.parametrize("source", ["argument", "ACCEL_USE_DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"])
def test_a_deepspeed_request_makes_the_distributed_type_deepspeed(
    monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    plugin = object()
    if source == "argument":
        state = AcceleratorState(deepspeed_plugin=plugin)
        assert state.deepspeed_plugin is plugin
        assert state.deepspeed_plugins == {"default": plugin}
    else:
        monkeypatch.setenv(source, "true")
        state = AcceleratorState()
        assert state.deepspeed_plugin is None
    assert state.distributed_type == DistributedType.DEEPSPEED


@pytest.mark.torch_feature("fully_shard")
@pytest.mark.parametrize("source", ["argument", "ACCEL_USE_FSDP", "ACCELERATE_USE_FSDP"])
def test_an_fsdp_request_makes_the_distributed_type_fsdp(
    monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    plugin = object()
    if source == "argument":
        state = AcceleratorState(fsdp_plugin=plugin)
        assert state.fsdp_plugin is plugin
    else:
        monkeypatch.setenv(source, "true")
        state = AcceleratorState()  # the Accelerator builds the plugin from FSDP_* later
        assert state.fsdp_plugin is None
    assert state.distributed_type == DistributedType.FSDP
    assert PartialState().distributed_type == DistributedType.NO  # the processes are as they are


@pytest.mark.parametrize(
    "variable",
    [
        "ACCEL_USE_MEGATRON_LM",
        "ACCELERATE_USE_MEGATRON_LM",
    ],
)
@pytest.mark.parametrize("from_accelerator", [False, True])
def test_engine_switches_are_refused_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch, variable: str, from_accelerator: bool
) -> None:
    hand_set(2, 1)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(EngineUnavailableError, match=f"{variable}=true in the environment"):
        AcceleratorState(_from_accelerator=from_accelerator)
    assert AcceleratorState._shared_state == {}
    assert not torch.distributed.is_initialized()


def test_false_engine_switches_ask_for_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "0")
    state = AcceleratorState()
    assert state.distributed_type == DistributedType.NO
    assert state.fsdp_plugin is None
    assert state.deepspeed_plugin is None


def test_a_switch_that_is_no_truth_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_USE_FSDP", "maybe")
    with pytest.raises(ValueError, match="ACCEL_USE_FSDP='maybe'"):
        AcceleratorState()


# --------------------------------------------------------------------------------------------
# GradientState
# --------------------------------------------------------------------------------------------


class FakePlugin:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def to_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)


class FakeLoader:
    def __init__(self, end_of_dataloader: bool = False, remainder: int = -1) -> None:
        self.end_of_dataloader = end_of_dataloader
        self.remainder = remainder


def test_gradient_state_defaults() -> None:
    state = GradientState()
    assert state.initialized
    assert state.sync_gradients is True
    assert state.num_steps == 1
    assert state.adjust_scheduler is True  # the plugin's default, honoured (Accelerate: False)
    assert state.sync_with_dataloader is True
    assert state.sync_each_batch is False
    assert state.end_of_dataloader is False
    assert state.remainder == -1
    assert state.active_dataloader is None
    assert state.in_dataloader is False
    assert state.plugin_kwargs == {}
    assert "Sync Gradients: True" in repr(state)


def test_gradient_state_is_a_borg() -> None:
    first = GradientState()
    first._set_sync_gradients(False)
    assert GradientState().sync_gradients is False
    assert GradientState().__dict__ is first.__dict__


def test_gradient_state_plugin_kwargs() -> None:
    plugin = FakePlugin(num_steps=4, adjust_scheduler=False, sync_with_dataloader=False)
    state = GradientState(plugin)
    assert state.num_steps == 4
    assert state.adjust_scheduler is False
    assert state.sync_with_dataloader is False
    # A later construction without a plugin keeps the settings.
    assert GradientState().num_steps == 4
    # A later construction with other settings replaces them all.
    GradientState(FakePlugin(num_steps=2, sync_each_batch=True))
    assert state.num_steps == 2
    assert state.adjust_scheduler is True
    assert state.sync_with_dataloader is True
    assert state.sync_each_batch is True


def test_gradient_state_advance_every_num_steps() -> None:
    state = GradientState(FakePlugin(num_steps=3))
    decisions = [state.advance() for _ in range(7)]
    assert decisions == [False, False, True, False, False, True, False]
    assert state.sync_gradients is False
    assert state.step == 7
    assert state.micro_batches_in_window == 1


def test_gradient_state_advance_closes_the_window_at_the_end_of_a_loader() -> None:
    state = GradientState(FakePlugin(num_steps=4))
    loader = FakeLoader()
    state._add_dataloader(loader)
    decisions = []
    windows = []
    for epoch_length in (6, 6):
        for index in range(epoch_length):
            loader.end_of_dataloader = index == epoch_length - 1
            decisions.append(state.advance())
            windows.append(state.micro_batches_in_window)
    # 6 batches with num_steps=4: windows of 4 and 2, and the count restarts each epoch.
    assert decisions == [False, False, False, True, False, True] * 2
    assert windows == [1, 2, 3, 4, 1, 2] * 2
    assert state.step == 0


def test_gradient_state_advance_ignores_the_loader_without_sync_with_dataloader() -> None:
    state = GradientState(FakePlugin(num_steps=4, sync_with_dataloader=False))
    state._add_dataloader(FakeLoader(end_of_dataloader=True))
    assert [state.advance() for _ in range(4)] == [False, False, False, True]


def test_gradient_state_reset() -> None:
    GradientState(FakePlugin(num_steps=3))
    GradientState._reset_state()
    assert GradientState._shared_state == {}
    assert GradientState().num_steps == 1


def test_gradient_state_dataloader_stack() -> None:
    state = GradientState()
    outer = FakeLoader(end_of_dataloader=False, remainder=3)
    inner = FakeLoader(end_of_dataloader=True, remainder=0)
    state._add_dataloader(outer)
    assert state.active_dataloader is outer
    assert state.in_dataloader
    assert (state.end_of_dataloader, state.remainder) == (False, 3)
    state._add_dataloader(inner)
    assert state.active_dataloader is inner
    assert (state.end_of_dataloader, state.remainder) == (True, 0)
    state._remove_dataloader(inner)
    assert state.active_dataloader is outer
    state._remove_dataloader(FakeLoader())  # not on the stack: nothing happens
    assert state.active_dataloader is outer
    state._remove_dataloader(outer)
    assert state.active_dataloader is None
    assert (state.end_of_dataloader, state.remainder) == (False, -1)
    state._remove_dataloader(outer)  # removing again is harmless
    assert state._dataloader_references == [None]


def test_gradient_state_removes_a_loader_out_of_order() -> None:
    state = GradientState()
    outer, inner = FakeLoader(), FakeLoader(remainder=5)
    state._add_dataloader(outer)
    state._add_dataloader(inner)
    state._remove_dataloader(outer)
    assert state.active_dataloader is inner
    assert len(state._dataloader_references) == 2


def test_gradient_state_holds_loaders_weakly() -> None:
    state = GradientState()
    loader = FakeLoader(end_of_dataloader=True, remainder=2)
    state._add_dataloader(loader)
    assert state.in_dataloader
    del loader
    gc.collect()
    assert state.active_dataloader is None
    assert state.in_dataloader is False
    assert state.end_of_dataloader is False
    assert state.remainder == -1


def test_split_yields_objects_without_a_length_unchanged() -> None:
    PartialState()
    PartialState._shared_state.update(
        num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
    )
    marker = object()
    with PartialState().split_between_processes(marker) as part:
        assert part is marker


def test_property_after_reset_explains_the_reset() -> None:
    """``Accelerator.prepare`` after ``AcceleratorState._reset_state()`` reads properties."""
    state = AcceleratorState()
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as info:
        _ = state.mixed_precision
    assert "`AcceleratorState` object has no attribute `mixed_precision`" in str(info.value)
    assert "AcceleratorState._reset_state()" in str(info.value)


def test_process_questions_are_answered_after_an_accelerator_state_reset() -> None:
    # As in Accelerate, whose test programs reset AcceleratorState between phases and keep
    # asking the still-initialised PartialState who they are.
    state = AcceleratorState()
    AcceleratorState._reset_state()
    assert PartialState._shared_state  # survived
    assert (state.is_main_process, state.is_local_main_process) == (True, True)
    assert (state.is_last_process, state.use_distributed) == (True, False)
    state.wait_for_everyone()
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    with pytest.raises(AttributeError, match="AcceleratorState._reset_state"):
        _ = state.device  # a field of the reset state, as in Accelerate


def test_process_questions_rebuild_a_reset_partial_state() -> None:
    state = AcceleratorState()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert state.is_local_main_process is True  # PartialState() is built again to answer
    assert PartialState._shared_state


def test_a_surviving_accelerator_state_rebuilds_a_reset_partial_state() -> None:
    AcceleratorState()
    held = PartialState()
    PartialState._reset_state()
    with pytest.raises(AttributeError, match="PartialState._reset_state"):
        _ = held.device
    AcceleratorState()  # what Accelerator(log_with=...) does next
    assert held.device == torch.device("cpu") and held.is_main_process


def test_gradient_state_counters_round_trip_for_exact_resume() -> None:
    state = GradientState()
    state.advance()
    assert state.window_open is False  # num_steps=1: every micro-batch closes its window
    saved = state.state_dict()
    assert list(saved) == ["step", "micro_batches_in_window", "window_closed", "sync_gradients"]
    state.step, state._window_closed = 7, False
    assert state.window_open
    state.load_state_dict(saved)
    assert state.state_dict() == saved
    with pytest.raises(KeyError, match="missing counters \\['sync_gradients'\\]"):
        state.load_state_dict({k: v for k, v in saved.items() if k != "sync_gradients"})


def test_fsdp_asked_of_a_state_built_without_it_is_refused() -> None:
    AcceleratorState()
    with pytest.raises(ValueError, match="already been initialized without FSDP"):
        AcceleratorState(fsdp_plugin=object())
    assert AcceleratorState().distributed_type == DistributedType.NO


def test_accelerates_variables_configure_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # `accelerate launch`, transformers and cluster scripts set Accelerate's names.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert AcceleratorState().mixed_precision == "bf16"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError) as info:
        AcceleratorState()
    assert "ACCEL_MIXED_PRECISION='fp16' and ACCELERATE_MIXED_PRECISION='bf16'" in str(info.value)
    assert AcceleratorState._shared_state == {}
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")  # the same value twice is fine
    assert AcceleratorState().mixed_precision == "bf16"


def test_a_bad_accelerate_precision_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp64")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION='fp64' is not a mixed"):
        AcceleratorState()
