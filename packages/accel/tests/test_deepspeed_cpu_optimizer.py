"""``map_pytorch_optim_to_deepspeed``: the DeepSpeed CPU optimizer standing for a torch one.

DeepSpeed's CPU optimizers JIT-compile a C++ op when built, so ``deepspeed`` and its
``deepspeed.ops`` modules are fakes here, with the real classes' signatures
(``DeepSpeedCPUAdagrad`` and ``DeepSpeedCPULion`` take no ``adamw_mode``). The checks: the
class chosen for each optimizer (Accelerate's rules), the arguments it gets, and that it holds
the very parameter groups (a scheduler made on the torch optimizer drives it).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from accel.utils import map_pytorch_optim_to_deepspeed


class _FakeCPUOptimizer(torch.optim.Optimizer):
    """Records its arguments; its groups are the torch optimizer's (as DeepSpeed's are)."""

    def __init__(self, model_params: Any, **kwargs: Any) -> None:
        super().__init__(model_params, {"lr": kwargs.get("lr", 1e-3)})
        self.kwargs = kwargs


class DeepSpeedCPUAdam(_FakeCPUOptimizer):
    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, weight_decay=weight_decay, adamw_mode=adamw_mode)


class DeepSpeedCPUAdagrad(_FakeCPUOptimizer):
    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, weight_decay=weight_decay)


class DeepSpeedCPULion(_FakeCPUOptimizer):
    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, weight_decay=weight_decay)


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = {
        "deepspeed": _module("deepspeed"),
        "deepspeed.ops": _module("deepspeed.ops"),
        "deepspeed.ops.adam": _module("deepspeed.ops.adam", DeepSpeedCPUAdam=DeepSpeedCPUAdam),
        "deepspeed.ops.adagrad": _module(
            "deepspeed.ops.adagrad", DeepSpeedCPUAdagrad=DeepSpeedCPUAdagrad
        ),
        "deepspeed.ops.lion": _module("deepspeed.ops.lion", DeepSpeedCPULion=DeepSpeedCPULion),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


@pytest.mark.parametrize(
    ("build", "cls", "kwargs"),
    [
        (
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
            DeepSpeedCPUAdam,
            {"lr": 0.01, "weight_decay": 0.1, "adamw_mode": True},
        ),
        (
            lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.9)),
            DeepSpeedCPUAdam,
            {"lr": 0.02, "weight_decay": 0, "adamw_mode": False},
        ),
        (
            lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
            DeepSpeedCPUAdam,
            {"lr": 0.5, "weight_decay": 0, "adamw_mode": False},
        ),
        (
            lambda p: torch.optim.Adagrad(p, lr=0.3, weight_decay=0.2),
            DeepSpeedCPUAdagrad,
            {"lr": 0.3, "weight_decay": 0.2},  # Accelerate passes adamw_mode: a TypeError
        ),
    ],
)
def test_each_torch_optimizer_maps_to_its_cpu_class(
    fake_deepspeed: None, build: Any, cls: type, kwargs: dict[str, Any]
) -> None:
    optimizer = build(_params())
    mapped = map_pytorch_optim_to_deepspeed(optimizer)
    assert type(mapped) is cls
    assert mapped.kwargs == kwargs
    # the very groups: their own settings (betas, momentum) and one learning rate to schedule
    assert all(a is b for a, b in zip(mapped.param_groups, optimizer.param_groups, strict=True))


def test_a_scheduler_on_the_torch_optimizer_drives_the_cpu_optimizer(fake_deepspeed: None) -> None:
    optimizer = torch.optim.AdamW(_params(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    mapped = map_pytorch_optim_to_deepspeed(optimizer)
    optimizer.step()
    scheduler.step()
    assert mapped.param_groups[0]["lr"] == pytest.approx(0.05)


class _Bits:
    def __init__(self, params: Any, optim_bits: int) -> None:
        self.param_groups = [{"params": list(params), "lr": 0.01}]
        self.defaults = {"lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.99)}
        self.optim_bits = optim_bits


@pytest.mark.parametrize(
    ("name", "bits", "cls", "adamw_mode"),
    [
        ("Lion", 32, DeepSpeedCPULion, None),
        ("Lion", 8, DeepSpeedCPUAdam, False),
        ("AdamW", 32, DeepSpeedCPUAdam, True),
        ("AdamW", 8, DeepSpeedCPUAdam, False),
        ("Adagrad", 32, DeepSpeedCPUAdagrad, None),
    ],
)
def test_bitsandbytes_optimizers_map_by_family_and_bits(
    fake_deepspeed: None,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    bits: int,
    cls: type,
    adamw_mode: bool | None,
) -> None:
    classes = {
        n: type(n, (_Bits,), {"__module__": "bitsandbytes.optim.fake"})
        for n in ("Lion", "Lion32bit", "AdamW", "AdamW32bit", "Adagrad", "Adagrad32bit")
    }
    bnb = _module("bitsandbytes")
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", _module("bitsandbytes.optim", **classes))
    mapped = map_pytorch_optim_to_deepspeed(classes[name](_params(), optim_bits=bits))
    assert type(mapped) is cls
    assert mapped.kwargs.get("adamw_mode") == adamw_mode


def test_something_else_is_refused_naming_it(fake_deepspeed: None) -> None:
    with pytest.raises(TypeError, match=r"optimizer=\[1, 2\]\): pass a torch optimizer"):
        map_pytorch_optim_to_deepspeed([1, 2])  # type: ignore[arg-type]


def test_without_deepspeed_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "accel\[deepspeed\]"'):
        map_pytorch_optim_to_deepspeed(torch.optim.AdamW(_params()))
