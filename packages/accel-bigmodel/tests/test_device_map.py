"""Device maps: infer_auto_device_map (golden maps from Accelerate 1.15), check and clean."""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from accel_bigmodel.device_map import check_device_map, clean_device_map, infer_auto_device_map
from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.sizes import CustomDtype


class BlockWithBuffer(nn.Module):
    """A module with children *and* a direct buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)
        self.register_buffer("mask", torch.ones(10))


def three_layers(model_for_test: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            [
                ("layer1", model_for_test()),
                ("layer2", model_for_test()),
                ("layer3", model_for_test()),
            ]
        )
    )


@pytest.fixture(autouse=True)
def _quiet_missing_device_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """Planning for GPUs this machine lacks logs a warning; keep the output readable."""
    caplog.set_level(logging.ERROR, logger="accel_bigmodel.memory")


def test_reserves_room_for_the_largest_layer_on_the_first_gpu(
    model_for_test: type[nn.Module],
) -> None:
    model = model_for_test()
    # Only linear1 fits on GPU 0: 100 bytes stay free for linear2, the largest layer.
    assert infer_auto_device_map(model, {0: 200, 1: 200}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }
    # Later GPUs keep no such room: 172 is exactly batchnorm + linear2.
    assert infer_auto_device_map(model, {0: 200, 1: 172, 2: 200}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }


def test_tied_weights_make_the_model_fit(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    model.linear1.weight = model.linear2.weight
    assert infer_auto_device_map(model, {0: 200, 1: 200}) == {"": 0}


def test_splits_at_layer_level_unless_no_split(model_for_test: type[nn.Module]) -> None:
    model = nn.Sequential(model_for_test(), model_for_test(), model_for_test())
    assert infer_auto_device_map(model, {0: 500, 1: 500}) == {
        "0": 0,
        "1.linear1": 0,
        "1.batchnorm": 0,
        "1.linear2": 1,
        "2": 1,
    }
    assert infer_auto_device_map(
        model, {0: 500, 1: 500}, no_split_module_classes=["ModelForTest"]
    ) == {"0": 0, "1": 1, "2": 1}
    assert infer_auto_device_map(
        model, {0: 500, 1: 500}, no_split_module_classes="ModelForTest"
    ) == {
        "0": 0,
        "1": 1,
        "2": 1,
    }


def test_tied_weights_across_blocks(model_for_test: type[nn.Module]) -> None:
    model = three_layers(model_for_test)
    model.layer3.linear2.weight = model.layer1.linear2.weight
    assert infer_auto_device_map(model, {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer3.linear2": 0,
        "layer2": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }

    model.layer2.linear2.weight = model.layer1.linear2.weight
    assert infer_auto_device_map(model, {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.linear1": 1,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }

    model.layer2.linear1.weight = model.layer1.linear1.weight
    assert infer_auto_device_map(model, {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer2.linear1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }


def test_tied_weights_in_one_sequential() -> None:
    model = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(4, 4)),
                ("linear2", nn.Linear(6, 6)),
                ("linear3", nn.Linear(4, 4)),
                ("linear4", nn.Linear(6, 6)),
            ]
        )
    )
    model.linear3.weight = model.linear1.weight
    model.linear3.bias = model.linear1.bias
    assert infer_auto_device_map(model, {0: 250, 1: 400}) == {
        "linear1": 0,
        "linear2": 1,
        "linear3": 0,
        "linear4": 1,
    }


def test_tied_parameter_sharing_a_name_prefix() -> None:
    """``compute.weight`` and ``compute.weight_submodule.parameter`` are different names."""

    class SubModule(nn.Module):
        def __init__(self, parameter: nn.Parameter) -> None:
            super().__init__()
            self.parameter = parameter

    class LinearAndSubModule(nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 8)
            self.weight_submodule = SubModule(self.weight)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.compute = LinearAndSubModule()

    device_map = infer_auto_device_map(Model(), {0: 4, "cpu": 96000})
    assert device_map == {"": "cpu"}


def test_buffers_of_offloaded_modules_warn(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    expected = {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}
    with pytest.warns(UserWarning, match="280 bytes of buffers"):
        assert infer_auto_device_map(model, {0: 400, "cpu": "1GB"}) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            infer_auto_device_map(model, {0: 400, "cpu": "1GB"}, offload_buffers=True) == expected
        )


def test_buffers_of_offloaded_modules_with_two_gpus(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    model.linear3 = nn.Linear(4, 5)
    model.linear3.register_buffer("test_buffer4", torch.zeros(10, 2))
    expected = {"linear1": 0, "batchnorm": 1, "linear2": "cpu", "linear3": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert infer_auto_device_map(model, {0: 400, 1: 400, "cpu": "1GB"}) == expected
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        assert infer_auto_device_map(model, {0: 400, 1: 200, "cpu": "1GB"}) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            infer_auto_device_map(model, {0: 400, 1: 200, "cpu": "1GB"}, offload_buffers=True)
            == expected
        )


@pytest.mark.filterwarnings("ignore:The modules placed on cpu/disk")
def test_cpu_and_disk(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    expected = {"linear1": "cpu", "batchnorm": "disk", "linear2": "disk"}
    # Like Accelerate, what does not fit goes to disk whether or not "disk" is a key: the
    # loader is the one that knows whether an offload folder is needed (and says so).
    assert infer_auto_device_map(model, {0: 100, "cpu": 200}) == expected
    assert infer_auto_device_map(model, {0: 100, "cpu": 200, "disk": 0}) == expected
    assert infer_auto_device_map(model, {}) == {"": "disk"}


def test_only_the_cpu_reserves_room_without_gpus(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    # 230 - 100 kept for linear2 leaves 130: linear1 fits, batchnorm does not.
    assert infer_auto_device_map(model, {"cpu": 230}) == {
        "linear1": "cpu",
        "batchnorm": "disk",
        "linear2": "disk",
    }
    # The last layer to place needs no room kept for a later one.
    assert infer_auto_device_map(model, {"cpu": 236}) == {"": "cpu"}


@pytest.mark.filterwarnings("ignore:The modules placed on cpu/disk")
def test_mps_is_the_only_main_device(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    assert infer_auto_device_map(model, {"mps": 200, "cpu": 200}) == {
        "linear1": "mps",
        "batchnorm": "cpu",
        "linear2": "cpu",
    }


def test_clean_result_false_keeps_every_entry(model_for_test: type[nn.Module]) -> None:
    model = nn.Sequential(model_for_test(), model_for_test())
    device_map = infer_auto_device_map(model, {0: 10_000}, clean_result=False)
    assert device_map == {"0": 0, "1": 0}
    assert infer_auto_device_map(model, {0: 10_000}) == {"": 0}


def test_dtype_and_special_dtypes(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    assert infer_auto_device_map(model, {0: 150, 1: 200}, dtype=torch.float16) == {"": 0}
    assert infer_auto_device_map(
        model,
        {0: 150, 1: 200},
        dtype="float16",
        special_dtypes={"linear1.weight": torch.float32, "linear1.bias": "float32"},
    ) == {"linear1": 0, "batchnorm": 1, "linear2": 1}
    assert infer_auto_device_map(model, {0: 100}, dtype=CustomDtype.INT4) == {"": 0}


def test_fallback_allocation_fills_an_empty_device(model_for_test: type[nn.Module]) -> None:
    model = nn.Sequential(
        OrderedDict(
            [("big", nn.Linear(20, 20)), ("small", nn.Linear(2, 2)), ("mid", model_for_test())]
        )
    )
    budget = {0: 1750, 1: 2000, "cpu": 5000}
    assert infer_auto_device_map(model, budget) == {"": 1}
    device_map = infer_auto_device_map(model, budget, fallback_allocation=True)
    assert device_map == {"small": 0, "big": 1, "mid": 1}
    assert list(device_map) == ["small", "big", "mid"]
    budget = {0: 1750, 1: 30, "cpu": 5000}
    assert infer_auto_device_map(model, budget, fallback_allocation=True) == {
        "small": 0,
        "big": "cpu",
        "mid": "cpu",
    }


def test_meta_model(model_for_test: type[nn.Module]) -> None:
    with init_empty_weights():
        model = nn.Sequential(model_for_test(), model_for_test(), model_for_test())
    assert infer_auto_device_map(model, {0: 500, 1: 500}) == {
        "0": 0,
        "1.linear1": 0,
        "1.batchnorm": 0,
        "1.linear2": 1,
        "2": 1,
    }


def test_verbose_prints_decisions(
    capsys: pytest.CaptureFixture[str], model_for_test: type[nn.Module]
) -> None:
    model = model_for_test()
    model.linear1 = nn.Linear(4, 5)
    model.linear2.weight = model.linear1.weight
    infer_auto_device_map(model, {0: 100, 1: 300}, verbose=True)
    out = capsys.readouterr().out
    assert "Treating linear1." in out
    assert "Tied to parameters outside it: ['linear2.weight']" in out
    assert "Placing linear1 with ['linear2'] on 1" in out
    assert "moving to the next device" in out


def test_bad_max_memory(model_for_test: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match="'gpu0'"):
        infer_auto_device_map(model_for_test(), {"gpu0": 100})
    with pytest.raises(ValueError, match=r"max_memory\[0\]"):
        infer_auto_device_map(model_for_test(), {0: "a lot"})


# Cases where Accelerate 1.15 fails or loses a tensor (listed in docs/compat.md).


def test_split_module_keeps_its_direct_buffers() -> None:
    model = nn.Sequential(BlockWithBuffer(), BlockWithBuffer())
    device_map = infer_auto_device_map(model, {0: 700, 1: 2000}, clean_result=False)
    # Accelerate drops "0.mask" here, so the map does not cover the model.
    assert device_map == {"0.a": 1, "0.b": 1, "0.mask": 1, "1": 1}
    check_device_map(model, device_map)


def test_many_numbered_children_with_tied_weights() -> None:
    # Accelerate raises IndexError: "1." is a substring of "11.weight".
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(12)])
    model[11].weight = model[0].weight
    device_map = infer_auto_device_map(model, {0: 100, 1: 1000}, clean_result=False)
    assert device_map["0"] == device_map["11"]
    check_device_map(model, device_map)


def test_tied_holder_split_into_parameters() -> None:
    """A tied partner in a split module is found as a parameter entry (Accelerate: IndexError)."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16, 16))
            self.extra = nn.Linear(16, 16)

    model = nn.Sequential(OrderedDict([("embed", nn.Linear(16, 16)), ("holder", Holder())]))
    model.holder.weight = model.embed.weight
    # embed + holder (2176 bytes) do not fit in 2500 - 1088 kept for the largest layer, embed
    # alone does: holder is split, and its direct parameter entry holder.weight goes with embed.
    device_map = infer_auto_device_map(model, {0: 2500, 1: 4000}, clean_result=False)
    assert device_map == {"embed": 0, "holder.weight": 0, "holder.extra": 0}
    check_device_map(model, device_map)


def test_fallback_allocation_with_fractional_sizes() -> None:
    # Accelerate raises AttributeError: the room left (a float) goes to convert_file_size_to_int.
    masked = nn.Module()
    masked.register_buffer("mask", torch.ones(9, dtype=torch.bool))  # 1.125 bytes
    masked.codes = nn.Parameter(torch.zeros(9, 9, dtype=torch.int8), requires_grad=False)
    model = nn.Sequential(masked, nn.Linear(2, 2), nn.Linear(3, 3))
    assert infer_auto_device_map(model, {0: 100, 1: 200}, fallback_allocation=True) == {"": 1}
    assert infer_auto_device_map(model, {0: 110, 1: 200}, fallback_allocation=True) == {
        "1": 0,
        "0": 1,
        "2": 1,
    }


def test_check_device_map(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    check_device_map(model, {"": 0})
    check_device_map(model, {"linear1": 0, "linear2": 1, "batchnorm": "cpu"})
    check_device_map(
        model, {"linear1": "cuda:0", "linear2": "disk", "batchnorm": torch.device("cpu")}
    )
    with pytest.raises(ValueError, match="batchnorm.weight, batchnorm.bias") as raised:
        check_device_map(model, {"linear1": 0, "linear2": 1})
    assert "num_batches_tracked" in str(raised.value)


def test_check_device_map_rejects_unknown_devices(model_for_test: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match=r"device_map\['linear1'\]='gpu'"):
        check_device_map(model_for_test(), {"linear1": "gpu", "linear2": 1, "batchnorm": 1})
    with pytest.raises(ValueError, match=r"device_map\[''\]=-1"):
        check_device_map(model_for_test(), {"": -1})
    with pytest.raises(TypeError, match="has type list"):
        check_device_map(model_for_test(), [("", 0)])  # type: ignore[arg-type]


def test_check_device_map_warns_on_unknown_keys_only(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    with pytest.warns(UserWarning, match=r"\['linear3'\]"):
        check_device_map(model, {"": 0, "linear3": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Parameter and buffer names are valid keys (infer_auto_device_map makes them).
        check_device_map(
            model,
            {
                "linear1.weight": 0,
                "linear1.bias": 0,
                "batchnorm.weight": 0,
                "batchnorm.bias": 0,
                "batchnorm.running_mean": 0,
                "batchnorm.running_var": 0,
                "batchnorm.num_batches_tracked": 0,
                "linear2": 1,
            },
        )


def test_clean_device_map() -> None:
    assert clean_device_map({"a": 0, "b": 0, "c": 0}) == {"": 0}
    assert clean_device_map({"a.x": 0, "a.y": 0, "b.x": 1, "b.y": 1, "c": 1}) == {
        "a": 0,
        "b": 1,
        "c": 1,
    }
    assert clean_device_map(
        {"a.x": 0, "a.y": 0, "b.x.0": 1, "b.x.1": 1, "b.y.0": 2, "b.y.1": 2, "c": 2}
    ) == {"a": 0, "b.x": 1, "b.y": 2, "c": 2}
    # One entry alone is not merged into its parent.
    assert clean_device_map({"a.x": 0, "b": 1}) == {"a.x": 0, "b": 1}
    assert clean_device_map({}) == {}


def test_clean_device_map_keeps_model_order_and_mutates_in_place() -> None:
    device_map = OrderedDict([("a.x", 0), ("a.y", 0), ("b", 1), ("c.x", 2), ("c.y", 2), ("d", 0)])
    result = clean_device_map(device_map)
    assert result is device_map
    assert list(device_map.items()) == [("a", 0), ("b", 1), ("c", 2), ("d", 0)]


def test_clean_device_map_from_a_submodule() -> None:
    device_map = {"a.x": 0, "a.y": 0, "b.x": 1, "b.y": 1}
    assert clean_device_map(device_map, "a") == {"a": 0, "b.x": 1, "b.y": 1}
