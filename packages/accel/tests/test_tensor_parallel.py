"""The tensor-parallel helpers in one process: plans, the model's own plan, bad arguments.

Splitting itself needs a mesh of several ranks: ``test_tensor_parallel_multiprocess.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from accel.tensor_parallel import model_plan
from accel.utils import TENSOR_PARALLEL_STYLES, apply_tensor_parallel, tensor_parallel_plan


def test_each_style_name_is_its_torch_style() -> None:
    plan = tensor_parallel_plan(
        {
            "a": "colwise",
            "b": "rowwise",
            "c": "colwise_rep",
            "d": "rowwise_rep",
            "e": "sequence_parallel",
            "f": "colwise_gather_output",
        }
    )
    assert type(plan["a"]) is ColwiseParallel and type(plan["b"]) is RowwiseParallel
    assert plan["c"].output_layouts == (Replicate(),)
    assert plan["d"].input_layouts == (Replicate(),)
    assert type(plan["e"]) is SequenceParallel
    assert plan["f"].output_layouts == (Replicate(),)
    own = RowwiseParallel(use_local_output=False)
    assert tensor_parallel_plan({"x": own})["x"] is own  # torch styles pass through


def test_the_documented_names_are_exactly_the_ones_understood() -> None:
    names = set(TENSOR_PARALLEL_STYLES)
    assert names == {
        "colwise",
        "rowwise",
        "colwise_rep",
        "colwise_gather_output",
        "rowwise_rep",
        "embedding_rowwise",
        "sequence_parallel",
    }
    assert set(tensor_parallel_plan({name: name for name in names})) == names


def test_bad_plans_name_the_entry_and_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        tensor_parallel_plan({"layers.*.up": "diagonal"})
    message = str(info.value)
    assert "plan['layers.*.up']='diagonal' is not a style accel knows" in message
    assert "colwise, rowwise, colwise_rep" in message and "ParallelStyle" in message
    with pytest.raises(TypeError, match=r"plan\['x'\]=3: expected a style name"):
        tensor_parallel_plan({"x": 3})
    with pytest.raises(TypeError, match="expected a dict of module name patterns"):
        tensor_parallel_plan(["colwise"])  # type: ignore[arg-type]


class _Config:
    base_model_tp_plan = {"layers.*.q": "colwise", "layers.*.o": "rowwise"}


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])


class _ForCausalLM(nn.Module):
    """transformers' layout: the base model under ``base_model_prefix``, a head with its plan."""

    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.model = _Base()
        self.lm_head = nn.Linear(4, 8)


def test_a_transformers_model_carries_its_plan_under_its_base_model() -> None:
    assert model_plan(_ForCausalLM()) == {
        "model.layers.*.q": "colwise",
        "model.layers.*.o": "rowwise",
        "lm_head": "colwise_gather_output",
    }
    assert model_plan(nn.Linear(2, 2)) is None


def test_apply_needs_a_mesh_and_a_plan() -> None:
    with pytest.raises(TypeError, match="expected a torch DeviceMesh"):
        apply_tensor_parallel(nn.Linear(2, 2), "tp", {"": "colwise"})
    with pytest.raises(TypeError, match="expected a torch DeviceMesh"):
        apply_tensor_parallel(nn.Linear(2, 2), torch.zeros(2), None)
