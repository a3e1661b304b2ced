"""The hook protocol, AlignDevicesHook, block hooks and the weight materialiser interface."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

from accel_bigmodel.hooks import (
    SYNCHRONOUS_MATERIALIZER,
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    WeightMaterializer,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    find_align_devices_hook,
    get_block_hooks,
    has_offloaded_params,
    remove_hook_from_module,
    remove_hook_from_submodules,
    set_weight_materializer,
)

# Tiny tensors: intra-op threads only add waits (conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))


class AddOne(ModelHook):
    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (args[0] + 1, *args[1:]), kwargs


class TimesTwo(ModelHook):
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output * 2


class Record(ModelHook):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.log.append(f"init {self.name}")
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.log.append(f"pre {self.name}")
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.log.append(f"post {self.name}")
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        self.log.append(f"detach {self.name}")
        return module


# -- add / remove ------------------------------------------------------------------------


def test_add_hook_changes_only_this_instance() -> None:
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    original = model.forward
    expected = model(X + 1)
    add_hook_to_module(model, AddOne())
    assert model._old_forward == original
    assert isinstance(model._hf_hook, AddOne)
    assert torch.equal(model(X), expected)
    assert model.forward.__name__ == "forward"
    assert "forward" not in other.__dict__


def test_pre_and_post_forward_see_kwargs() -> None:
    class KwargHook(ModelHook):
        def pre_forward(
            self, module: nn.Module, *args: Any, **kwargs: Any
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            kwargs["scale"] = 10.0
            return args, kwargs

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x * scale

    module = Scaled()
    add_hook_to_module(module, KwargHook())
    assert torch.equal(module(X, scale=3.0), X * 10)


def test_replacing_a_hook_keeps_the_original_forward() -> None:
    model = nn.Linear(3, 3)
    original = model.forward
    expected = model(X)
    add_hook_to_module(model, AddOne())
    add_hook_to_module(model, TimesTwo())
    assert model._old_forward == original
    assert isinstance(model._hf_hook, TimesTwo)
    assert torch.equal(model(X), expected * 2)


def test_append_chains_hooks_in_order() -> None:
    model = nn.Linear(3, 3)
    expected = model(X + 1) * 2
    log: list[str] = []
    add_hook_to_module(model, AddOne())
    add_hook_to_module(model, TimesTwo(), append=True)
    assert isinstance(model._hf_hook, SequentialHook)
    assert [type(hook) for hook in model._hf_hook.hooks] == [AddOne, TimesTwo]
    assert torch.equal(model(X), expected)
    add_hook_to_module(model, Record("third", log), append=True)
    assert len(model._hf_hook.hooks) == 2  # (Sequential(AddOne, TimesTwo), Record)
    model(X)
    assert log == ["init third", "pre third", "post third"]


def test_append_on_an_unhooked_module_is_a_plain_add() -> None:
    model = nn.Linear(3, 3)
    add_hook_to_module(model, AddOne(), append=True)
    assert isinstance(model._hf_hook, AddOne)


def test_remove_restores_the_original_forward_exactly() -> None:
    model = nn.Linear(3, 3)
    expected = model(X)
    add_hook_to_module(model, AddOne())
    add_hook_to_module(model, TimesTwo(), append=True)
    remove_hook_from_module(model)
    assert "forward" not in model.__dict__
    assert not hasattr(model, "_hf_hook") and not hasattr(model, "_old_forward")
    assert model.forward.__func__ is nn.Linear.forward  # type: ignore[attr-defined]
    assert torch.equal(model(X), expected)


def test_remove_restores_an_instance_level_forward() -> None:
    model = nn.Linear(3, 3)

    def custom(x: torch.Tensor) -> torch.Tensor:
        return x

    model.forward = custom  # type: ignore[method-assign]
    add_hook_to_module(model, TimesTwo())
    assert torch.equal(model(X), X * 2)
    remove_hook_from_module(model)
    assert model.forward is custom


def test_remove_runs_detach_and_recurses() -> None:
    log: list[str] = []
    model = _net()
    add_hook_to_module(model, Record("root", log))
    add_hook_to_module(model.linear1, Record("child", log))
    remove_hook_from_module(model)
    assert log == ["init root", "init child", "detach root"]
    assert hasattr(model.linear1, "_hf_hook")
    add_hook_to_module(model, Record("root", log))
    remove_hook_from_module(model, recurse=True)
    assert log[-2:] == ["detach root", "detach child"]
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    remove_hook_from_module(model)  # nothing attached: a no-op


def test_remove_hook_from_submodules() -> None:
    model = _net()
    for module in model.modules():
        add_hook_to_module(module, ModelHook())
    remove_hook_from_submodules(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_no_grad() -> None:
    class NoGrad(ModelHook):
        no_grad = True

    model = nn.Linear(3, 3)
    assert model(X).requires_grad
    add_hook_to_module(model, NoGrad())
    assert not model(X).requires_grad
    add_hook_to_module(model, AddOne(), append=True)
    assert model._hf_hook.no_grad
    assert not model(X).requires_grad
    remove_hook_from_module(model)
    add_hook_to_module(model, AddOne())
    assert model(X).requires_grad


def test_init_hook_may_replace_the_module() -> None:
    replacement = nn.Linear(3, 3)

    class Swap(ModelHook):
        def init_hook(self, module: nn.Module) -> nn.Module:
            return replacement

    original = nn.Linear(3, 3)
    returned = add_hook_to_module(original, Swap())
    assert returned is replacement
    assert isinstance(replacement._hf_hook, Swap)
    assert torch.equal(returned(X), replacement._old_forward(X))


def test_graph_modules_are_patched_on_their_class() -> None:
    traced = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    expected = traced(X)
    add_hook_to_module(traced, TimesTwo())
    assert "forward" not in traced.__dict__
    assert torch.equal(traced(X), expected * 2)
    remove_hook_from_module(traced)
    assert torch.equal(traced(X), expected)


def test_sequential_hook_detach_and_repr() -> None:
    log: list[str] = []
    hook = SequentialHook(Record("a", log), Record("b", log))
    module = nn.Linear(3, 3)
    assert hook.init_hook(module) is module
    assert hook.detach_hook(module) is module
    assert log == ["init a", "init b", "detach a", "detach b"]
    assert repr(hook).startswith("SequentialHook(")


# -- AlignDevicesHook -------------------------------------------------------------------


def test_offload_round_trip_keeps_weights_on_meta_between_calls() -> None:
    model = _net()
    expected = model(X)
    state = {k: v.clone() for k, v in model.linear1.state_dict().items()}
    hook = AlignDevicesHook("cpu", offload=True)
    add_hook_to_module(model.linear1, hook)
    assert model.linear1.weight.device.type == "meta"
    assert hook.offloaded_names == ("weight", "bias")
    assert has_offloaded_params(model.linear1) and not has_offloaded_params(model.linear2)
    for _ in range(2):
        assert torch.equal(model(X), expected)
        assert model.linear1.weight.device.type == "meta"
    remove_hook_from_module(model.linear1)
    assert torch.equal(model.linear1.weight, state["weight"])
    assert type(model.linear1.weight) is nn.Parameter and model.linear1.weight.requires_grad


def test_offloaded_cpu_weights_are_used_without_copy() -> None:
    module = nn.Linear(3, 4)
    weights = {"weight": module.weight.detach().clone(), "bias": module.bias.detach().clone()}
    seen: list[int] = []
    add_hook_to_module(module, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    original = module.__dict__["_old_forward"]

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(module.weight.data_ptr())
        return original(x)

    module.__dict__["_old_forward"] = spy
    module(X)
    assert seen == [weights["weight"].data_ptr()]


def test_offload_buffers() -> None:
    model = _net()
    expected = model(X)
    model.batchnorm.register_buffer("scratch", torch.ones(4), persistent=False)
    add_hook_to_module(model.batchnorm, AlignDevicesHook("cpu", offload=True, offload_buffers=True))
    assert model.batchnorm.running_mean is not None
    assert model.batchnorm.running_mean.device.type == "meta"
    assert model.batchnorm.scratch.device.type == "cpu"  # non-persistent: stays
    assert "running_mean" in find_align_devices_hook(model.batchnorm).offloaded_names  # type: ignore[union-attr]
    assert torch.equal(model(X), expected)
    remove_hook_from_module(model.batchnorm)
    assert model.batchnorm.running_mean.device.type == "cpu"


def test_offload_without_weights_of_meta_tensors_is_refused() -> None:
    module = nn.Linear(3, 3).to("meta")
    with pytest.raises(ValueError, match=r"\['weight', 'bias'\] are on the meta device"):
        add_hook_to_module(module, AlignDevicesHook("cpu", offload=True))


def test_missing_weight_in_the_weights_map_is_named() -> None:
    module = nn.Linear(3, 3)
    add_hook_to_module(
        module, AlignDevicesHook("cpu", offload=True, weights_map={"weight": module.weight})
    )
    with pytest.raises(KeyError, match="no entry for 'bias'"):
        module(X)


def test_execution_device_is_validated() -> None:
    with pytest.raises(ValueError, match="execution_device='disk'"):
        AlignDevicesHook("disk")
    with pytest.raises(ValueError, match="execution_device='gpu'"):
        AlignDevicesHook("gpu")
    hook = AlignDevicesHook(0)
    assert hook.execution_device == 0 and hook.target_device is not None
    assert hook.target_device.index == 0


def test_inputs_move_to_the_execution_device_except_skip_keys() -> None:
    hook = AlignDevicesHook("meta", skip_keys=["keep"])
    t = torch.ones(2)
    args, kwargs = hook.pre_forward(nn.Identity(), t, {"nested": t}, keep=t, other=[t])
    assert args[0].device.type == "meta" and args[1]["nested"].device.type == "meta"
    assert kwargs["keep"] is t
    assert kwargs["other"][0].device.type == "meta"
    hook.skip_keys = None
    _, kwargs = hook.pre_forward(nn.Identity(), keep=t)
    assert kwargs["keep"].device.type == "meta"
    untouched = AlignDevicesHook()
    assert untouched.pre_forward(nn.Identity(), t, k=t) == ((t,), {"k": t})


def test_io_same_device_sends_the_output_back() -> None:
    class Output:
        def __init__(self) -> None:
            self.sent_to: list[Any] = []

        def to(self, device: Any, non_blocking: bool = False) -> Output:
            self.sent_to.append(device)
            return self

    output = Output()

    class Producer(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Output:
            return output

    module = Producer()
    hook = AlignDevicesHook(io_same_device=True)
    add_hook_to_module(module, hook)
    module(ids=torch.ones(2, dtype=torch.long))
    assert hook.input_device == torch.device("cpu")
    assert output.sent_to == [torch.device("cpu")]
    module("no tensors")
    assert hook.input_device is None and len(output.sent_to) == 1


def test_place_submodules_moves_everything_once() -> None:
    model = _net()
    hook = AlignDevicesHook("meta", place_submodules=True)
    add_hook_to_module(model, hook)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    assert hook.tied_params_map is None


def test_tied_weights_are_materialised_once_per_forward() -> None:
    class Child(nn.Module):
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 3))
            self.child = Child(self.weight)
            self.seen: list[bool] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.child(x @ self.weight)
            return out

    model = Parent()
    expected = model(X)
    shared = model.weight.detach()
    tied: dict[int, dict[Any, torch.Tensor]] = {shared.data_ptr(): {}}
    weights = {"weight": shared, "child.weight": shared}
    attach_align_device_hook(model, "cpu", offload=True, weights_map=weights, tied_params_map=tied)
    child_hook = find_align_devices_hook(model.child)
    assert child_hook is not None and child_hook.tied_params_names == {"weight"}
    reused: list[bool] = []
    original = model.child.__dict__["_old_forward"]

    def spy(x: torch.Tensor) -> torch.Tensor:
        reused.append(model.child.weight is model.weight)
        return original(x)

    model.child.__dict__["_old_forward"] = spy
    assert torch.equal(model(X), expected)
    assert reused == [True]
    assert tied == {shared.data_ptr(): {}}  # copies made during the call are forgotten


def test_an_exception_in_forward_does_not_poison_the_next_call() -> None:
    class Flaky(nn.Linear):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise RuntimeError("boom")
            return super().forward(x)

    module = Flaky(3, 3)
    expected = nn.Linear.forward(module, X)
    tied: dict[int, dict[Any, torch.Tensor]] = {module.weight.data_ptr(): {}}
    hook = AlignDevicesHook("cpu", offload=True, tied_params_map=tied)
    add_hook_to_module(module, hook)
    with pytest.raises(RuntimeError, match="boom"):
        module(X)
    assert hook.tied_pointers_to_remove
    module.fail = False
    assert torch.equal(module(X), expected)
    assert not hook.tied_pointers_to_remove
    assert module.weight.device.type == "meta"


def test_repr() -> None:
    assert repr(AlignDevicesHook("cpu", offload=True)) == (
        "AlignDevicesHook(execution_device=cpu, offload=True, io_same_device=False, "
        "offload_buffers=False, place_submodules=False, skip_keys=None)"
    )


# -- attaching to whole models ------------------------------------------------------------


def test_attach_align_device_hook_hooks_modules_with_direct_tensors() -> None:
    model = nn.Sequential(_net(), nn.ReLU())
    attach_align_device_hook(model, "cpu", offload=True, weights_map=model.state_dict())
    hooked = {name for name, m in model.named_modules() if find_align_devices_hook(m)}
    assert hooked == {"0.linear1", "0.batchnorm", "0.linear2"}
    hook = find_align_devices_hook(model[0].linear2)
    assert hook is not None and hook.weights_map is not None
    assert set(hook.weights_map) == {"weight", "bias"}


def test_preload_module_classes_stop_the_recursion() -> None:
    model = nn.Sequential(_net())
    expected = model(X)
    attach_align_device_hook(
        model,
        "cpu",
        offload=True,
        weights_map=dict(model.state_dict()),
        preload_module_classes=["Net"],
    )
    hook = find_align_devices_hook(model[0])
    assert hook is not None and hook.place_submodules
    assert "linear1.weight" in hook.offloaded_names
    assert find_align_devices_hook(model[0].linear1) is None
    assert torch.equal(model(X), expected)


def test_attach_execution_device_hook() -> None:
    model = nn.Sequential(_net(), nn.ReLU(), nn.Sequential(nn.Identity()))
    add_hook_to_module(model[0].linear1, TimesTwo())
    attach_execution_device_hook(model, "cpu", preload_module_classes=["Net"])
    assert isinstance(model._hf_hook, AlignDevicesHook)
    assert isinstance(model[0]._hf_hook, AlignDevicesHook)
    assert isinstance(model[0].linear1._hf_hook, TimesTwo)  # already hooked: left alone
    assert not hasattr(model[0].linear2, "_hf_hook")  # below a preload class
    assert not hasattr(model[1], "_hf_hook") and not hasattr(model[2], "_hf_hook")


def test_blocks_single_device() -> None:
    model = _net()
    attach_align_device_hook_on_blocks(model, "cpu")
    hook = find_align_devices_hook(model)
    assert hook is not None and hook.io_same_device and hook.place_submodules
    assert not hook.offload
    remove_hook_from_submodules(model)
    attach_align_device_hook_on_blocks(model, "cpu", offload=True, weights_map=model.state_dict())
    assert has_offloaded_params(model.linear1)


def test_block_hooks_know_their_successor() -> None:
    model = _net()
    expected = model(X)
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"linear1": "cpu", "batchnorm": "cpu", "linear2": "cpu", "": "cpu"},
        offload={"linear1": True, "batchnorm": False, "linear2": True},
        weights_map=model.state_dict(),
    )
    blocks = get_block_hooks(model)
    assert [h.block_name for h in blocks] == ["linear1", "batchnorm", "linear2"]
    assert [h.block_index for h in blocks] == [0, 1, 2]
    assert blocks[0].next_block_hook is blocks[1] and blocks[2].next_block_hook is None
    assert blocks[0].block_offload_hooks == [(model.linear1, blocks[0])]
    assert blocks[1].block_offload_hooks == []
    root = find_align_devices_hook(model)
    assert root is not None and root.io_same_device and root.block_name is None
    assert torch.equal(model(X), expected)


def test_whole_model_as_one_offloaded_block_returns_outputs_to_the_caller() -> None:
    model = nn.Linear(3, 3)
    expected = model(X)
    attach_align_device_hook_on_blocks(
        model, execution_device={"": "cpu"}, offload={"": True}, weights_map=model.state_dict()
    )
    hook = find_align_devices_hook(model)
    assert hook is not None and hook.offload and hook.io_same_device
    assert hook.block_name == "" and get_block_hooks(model) == [hook]
    assert torch.equal(model(X), expected)


class RecordingMaterializer:
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []
        self.names: dict[int, str] = {}

    def block_started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        following = hook.next_block_hook.block_name if hook.next_block_hook else None
        self.events.append(("block", f"{hook.block_name}->{following}"))

    def materialize(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        self.events.append(("load", self.names[id(module)]))
        SYNCHRONOUS_MATERIALIZER.materialize(hook, module)

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        self.events.append(("drop", self.names[id(module)]))
        SYNCHRONOUS_MATERIALIZER.release(hook, module)


def test_weight_materializer_interface_sees_blocks_in_order() -> None:
    model = nn.Sequential(_net(), _net())
    x = torch.randn(2, 3)
    model[1].linear1 = nn.Linear(5, 4)
    expected = model(x)
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"0": "cpu", "1": "cpu", "": "cpu"},
        offload={"0": True, "1": True},
        weights_map=model.state_dict(),
    )
    recorder = RecordingMaterializer()
    assert isinstance(recorder, WeightMaterializer)
    recorder.names = {id(m): name for name, m in model.named_modules()}
    set_weight_materializer(model, recorder)
    assert torch.equal(model(x), expected)
    assert recorder.events == [
        ("block", "0->1"),
        ("load", "0.linear1"),
        ("drop", "0.linear1"),
        ("load", "0.batchnorm"),
        ("drop", "0.batchnorm"),
        ("load", "0.linear2"),
        ("drop", "0.linear2"),
        ("block", "1->None"),
        ("load", "1.linear1"),
        ("drop", "1.linear1"),
        ("load", "1.batchnorm"),
        ("drop", "1.batchnorm"),
        ("load", "1.linear2"),
        ("drop", "1.linear2"),
    ]
    set_weight_materializer(model, SYNCHRONOUS_MATERIALIZER)
    assert all(
        h.materializer is SYNCHRONOUS_MATERIALIZER
        for m in model.modules()
        if (h := find_align_devices_hook(m)) is not None
    )
    with pytest.raises(TypeError, match="is not a WeightMaterializer"):
        set_weight_materializer(model, object())  # type: ignore[arg-type]


# -- align_module_device / CpuOffload ----------------------------------------------------


def test_align_module_device_on_an_offloaded_module() -> None:
    module = nn.Linear(3, 3)
    weight = module.weight.detach().clone()
    add_hook_to_module(module, AlignDevicesHook("cpu", offload=True))
    with align_module_device(module):
        assert torch.equal(module.weight, weight)
    assert module.weight.device.type == "meta"
    hook = find_align_devices_hook(module)
    assert hook is not None
    with align_module_device(module, "cpu"):
        assert hook.execution_device == "cpu"
    assert hook.execution_device == "cpu" and module.weight.device.type == "meta"


def test_align_module_device_on_a_plain_module() -> None:
    module = nn.Linear(3, 3)
    weight = module.weight
    with align_module_device(module):
        assert module.weight is weight
    with align_module_device(module, "cpu"):
        assert module.weight.device.type == "cpu"
    assert module.weight.device.type == "cpu" and torch.equal(module.weight, weight)


def test_has_offloaded_params_sees_chained_hooks() -> None:
    module = nn.Linear(3, 3)
    add_hook_to_module(module, AlignDevicesHook(io_same_device=True))
    assert not has_offloaded_params(module)
    add_hook_to_module(module, AlignDevicesHook("cpu", offload=True), append=True)
    assert has_offloaded_params(module)
    assert not has_offloaded_params(nn.Linear(2, 2))


def test_cpu_offload_hook() -> None:
    model = _net()
    expected = model(X)
    hook = CpuOffload("cpu")
    add_hook_to_module(model, hook)
    assert torch.equal(model(X), expected)
    user = UserCpuOffloadHook(model, hook)
    user.offload()
    assert next(model.parameters()).device.type == "cpu"
    user.remove()
    assert not hasattr(model, "_hf_hook")
    assert CpuOffload().target_device.type in ("cpu", "cuda", "mps", "xpu", "npu")
    assert repr(CpuOffload("cpu")) == "CpuOffload(execution_device=cpu)"


def test_cpu_offload_hook_offloads_the_previous_model() -> None:
    first, second = _net(), nn.Linear(5, 2)
    first_hook = UserCpuOffloadHook(first, CpuOffload("cpu"))
    calls: list[str] = []
    first_hook.offload = lambda: calls.append("offload")  # type: ignore[method-assign]
    add_hook_to_module(second, CpuOffload("cpu", prev_module_hook=first_hook))
    second(first(X))
    assert calls == []  # the previous model is already on the CPU
    first.to("meta")
    second(torch.randn(2, 5))
    assert calls == ["offload"]
