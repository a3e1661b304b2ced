"""``FullyShardedDataParallelPlugin`` in one process: Accelerate's FSDP2 settings and their effect.

The behaviours of Accelerate 1.15's tests/fsdp/test_fsdp.py that run on a CPU (its plugin tests
under ``FSDP_VERSION=2`` and its one-rank prepare tests), checked against accel: values from the
``FSDP_*`` variables and from fields, the FSDP1-only settings dropped with Accelerate's logged
notes, precision policies, wrap policies (``SIZE_BASED_WRAP`` without a minimum wraps nothing),
``enable_/disable_fsdp_ram_efficient_loading``, and a one-rank FSDP2 ``prepare``: which modules
become units, which parameters become fp32 master weights, which stay plain tensors. The
multi-rank engine is test_fsdp2_multiprocess.py's.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from torch import nn

from accel_state.testing import require_reasons

if _missing := require_reasons(torch_features=("fully_shard",)):  # the floor, torch 2.5
    pytest.skip("; ".join(_missing), allow_module_level=True)

from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    FullStateDictConfig,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.distributed.tensor import DTensor

from accel import Accelerator
from accel.utils import (
    FullyShardedDataParallelPlugin,
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NOTES_LOGGER = "accel.utils.dataclasses"  # accelerate.utils.dataclasses, renamed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)  # 272 parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)  # 80 parameters
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _unset(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset ``names``; whatever the test then sets is undone too (delenv alone records nothing
    for a variable that was not set)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _units(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


# --- settings from the FSDP_* variables and the fields ----------------------------------------


@pytest.mark.parametrize(
    ("variables", "reshard"),
    [
        ({}, True),
        ({"FSDP_RESHARD_AFTER_FORWARD": "false"}, False),
        ({"FSDP_RESHARD_AFTER_FORWARD": "true"}, True),
        ({"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, False),
        ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, True),
        ({"FSDP_SHARDING_STRATEGY": "FULL_SHARD"}, True),
    ],
)
def test_resharding_comes_from_the_variables(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], reshard: bool
) -> None:
    monkeypatch.setenv("FSDP_VERSION", "2")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.reshard_after_forward is reshard and plugin.sharding_strategy is None


def test_resharding_fields_take_a_bool_or_a_strategy() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    assert (
        FullyShardedDataParallelPlugin(reshard_after_forward=False).reshard_after_forward is False
    )
    plugin = FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert plugin.reshard_after_forward is False and plugin.sharding_strategy is None


def test_offload_state_dict_and_wrap_settings_come_from_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer,Block")
    monkeypatch.setenv("FSDP_IGNORED_MODULES", r".*\.q_proj$")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "True")
    plugin = FullyShardedDataParallelPlugin()
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.state_dict_config == FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer", "Block"]
    assert plugin.ignored_modules == r".*\.q_proj$"
    assert plugin.cpu_ram_efficient_loading is True
    plugin.set_state_dict_type("SHARDED_STATE_DICT")  # Accelerate's switch before a save
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.state_dict_config == ShardedStateDictConfig(offload_to_cpu=True)
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    offload = FullyShardedDataParallelPlugin().cpu_offload
    assert isinstance(offload, OffloadPolicy) and not isinstance(offload, CPUOffloadPolicy)


def test_an_explicit_ram_efficient_loading_is_written_for_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "True")  # undone after the test
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False)
    assert plugin.cpu_ram_efficient_loading is False
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"  # from_pretrained reads it


@pytest.mark.parametrize(
    ("variables", "kwargs", "match"),
    [
        ({"FSDP_SHARDING_STRATEGY": "NO_SHARD"}, {}, "nothing would be sharded"),
        ({"FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"}, {}, "FSDP2 does not support LOCAL_STATE"),
        ({"FSDP_VERSION": "3"}, {}, "FSDP_VERSION='3': use 1 or 2"),
        ({"FSDP_BACKWARD_PREFETCH": "SOON"}, {}, "backward_prefetch='SOON'.*FSDP_BACKWARD_PRE"),
        ({}, {"fsdp_version": 3}, r"fsdp_version=3\): use 2"),
        ({}, {"forward_prefetch": True}, "forward_prefetch is not yet implemented in FSDP2"),
        ({}, {"auto_wrap_policy": "BY_SIZE"}, "Invalid auto wrap policy: BY_SIZE. Must be one"),
        (
            {},
            {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "100"},
            "`min_num_params` must be an integer",
        ),
        ({}, {"mixed_precision_policy": 42}, "must be an instance of `torch.distributed.fsdp"),
        (
            {},
            {"mixed_precision_policy": {"param_dtype": torch.int8}},
            r"mixed_precision_policy\['param_dtype'\]=torch.int8: use torch.bfloat16",
        ),
        (
            {},
            {"mixed_precision_policy": {"param_dtype": BF16, "buffer_dtype": BF16}},
            r"unknown keys \['buffer_dtype'\].*FSDP1's buffer_dtype",
        ),
        ({}, {"mixed_precision_policy": "fp64"}, "Invalid mixed precision: 'fp64'. Must be one"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], kwargs: dict[str, Any], match: str
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


# --- FSDP1-only settings: dropped with Accelerate's logged notes ------------------------------


BACKWARD_NOTE = "backward_prefetch is not supported in FSDP2. Setting backward prefetch to None."
ORIG_NOTE = "use_orig_params is obsolete in FSDP2, as FSDP2 always uses the original parameters."
SYNC_NOTE = (
    "sync_module_states is obsolete in FSDP2, as it is not needed anymore. Setting "
    "sync_module_states to None."
)


@pytest.mark.parametrize(
    ("variables", "kwargs", "note"),
    [
        ({"FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"}, {}, BACKWARD_NOTE),
        ({}, {"backward_prefetch": "BACKWARD_POST"}, BACKWARD_NOTE),
        ({}, {"backward_prefetch": "enum"}, BACKWARD_NOTE),
        ({}, {"use_orig_params": True}, ORIG_NOTE),
        ({}, {"sync_module_states": False}, SYNC_NOTE),
        ({"FSDP_BACKWARD_PREFETCH": "NO_PREFETCH"}, {}, None),
        ({}, {"backward_prefetch": "NO_PREFETCH"}, None),
    ],
)
def test_fsdp1_only_settings_are_dropped_with_accelerates_note(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    variables: dict[str, str],
    kwargs: dict[str, Any],
    note: str | None,
) -> None:
    from torch.distributed.fsdp import BackwardPrefetch

    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if kwargs.get("backward_prefetch") == "enum":
        kwargs = {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}
    with caplog.at_level(logging.WARNING, logger=NOTES_LOGGER):
        plugin = FullyShardedDataParallelPlugin(**kwargs)
    assert (plugin.backward_prefetch, plugin.use_orig_params, plugin.sync_module_states) == (
        None,
        None,
        None,
    )
    notes = [r.getMessage() for r in caplog.records if r.name == NOTES_LOGGER]
    assert notes == ([] if note is None else [note])


def test_several_fsdp1_settings_give_one_warning_with_every_note(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=NOTES_LOGGER):
        FullyShardedDataParallelPlugin(backward_prefetch="BACKWARD_PRE", use_orig_params=False)
    (record,) = [r for r in caplog.records if r.name == NOTES_LOGGER]
    assert record.getMessage().splitlines() == [BACKWARD_NOTE, ORIG_NOTE]


# --- precision policies -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "policy"),
    [
        ("bf16", MixedPrecisionPolicy(BF16, FP32, FP32)),  # accel reduces in fp32 (compat.md)
        ("fp16", MixedPrecisionPolicy(FP16, FP32, FP32)),
        ("fp8", MixedPrecisionPolicy(BF16, FP32, FP32)),
        (BF16, MixedPrecisionPolicy(BF16, FP32, FP32)),
        (FP32, MixedPrecisionPolicy()),
        ("fp32", MixedPrecisionPolicy()),
        (
            {"param_dtype": BF16, "reduce_dtype": BF16, "output_dtype": BF16},
            MixedPrecisionPolicy(BF16, BF16, BF16),  # a full dict is taken as given
        ),
        ({"param_dtype": "fp16", "reduce_dtype": "float32"}, MixedPrecisionPolicy(FP16, FP32)),
        (MixedPrecisionPolicy(FP16, FP16), MixedPrecisionPolicy(FP16, FP16)),
    ],
)
def test_precision_policies_come_from_names_dtypes_and_dicts(
    given: Any, policy: MixedPrecisionPolicy
) -> None:
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=given).mixed_precision_policy == (
        policy
    )


def test_set_mixed_precision_takes_dtypes_and_keeps_a_policy_unless_overridden() -> None:
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision(FP16)
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(FP16, FP32, FP32)
    plugin.set_mixed_precision(BF16)  # kept: a policy is set
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(FP16, FP32, FP32)
    plugin.set_mixed_precision(BF16, override=True)
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(BF16, FP32, FP32)
    with pytest.raises(ValueError, match=r"Invalid mixed precision: torch.int8. Must be one of"):
        plugin.set_mixed_precision(torch.int8, override=True)
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(BF16, FP32, FP32)  # unchanged


# --- RAM-efficient loading switches ---------------------------------------------------------


def test_ram_efficient_loading_switches_set_what_transformers_and_the_plugin_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    _unset(monkeypatch, "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCEL_USE_FSDP", "ACCELERATE_USE_FSDP")
    enable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True"
    assert os.environ["ACCELERATE_USE_FSDP"] == "True"  # transformers' is_fsdp_enabled()
    assert os.environ["ACCEL_USE_FSDP"] == "True"
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is True
    disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"
    assert os.environ["ACCEL_USE_FSDP"] == "True"  # the switch is not turned off
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is False


@pytest.mark.parametrize("name", ["ACCEL_USE_FSDP", "ACCELERATE_USE_FSDP"])
def test_enabling_ram_efficient_loading_keeps_the_runs_fsdp_switch(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import os

    _unset(monkeypatch, "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCEL_USE_FSDP", "ACCELERATE_USE_FSDP")
    monkeypatch.setenv(name, "false")
    enable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True"
    assert {k: v for k, v in os.environ.items() if k.endswith("_USE_FSDP")} == {name: "false"}


# --- wrap policies ----------------------------------------------------------------------------


def test_set_auto_wrap_policy_binds_torchs_policy_to_the_model_as_accelerate_does() -> None:
    model = Net()
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    predicate = plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    assert isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy
    assert policy.keywords == {"transformer_layer_cls": {Block}}
    assert predicate is not None
    assert predicate(model.blocks[0], set()) and not predicate(model.inp, set())

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=200)
    predicate = plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    assert isinstance(policy, functools.partial) and policy.func is size_based_auto_wrap_policy
    assert policy.keywords == {"min_num_params": 200}
    assert predicate is not None
    assert predicate(model.blocks[0].lin, set()) and not predicate(model.inp, set())


@pytest.mark.parametrize(
    "kwargs", [{"auto_wrap_policy": "SIZE_BASED_WRAP"}, {"auto_wrap_policy": "NO_WRAP"}]
)
def test_no_wrap_and_size_without_a_minimum_wrap_nothing(kwargs: dict[str, Any]) -> None:
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    assert plugin.set_auto_wrap_policy(Net()) is None
    assert plugin.auto_wrap_policy is None


def test_an_unknown_class_to_wrap_is_refused_and_changes_nothing() -> None:
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["T5Layer"]
    )
    with pytest.raises(ValueError, match="Could not find the transformer layer class T5Layer"):
        plugin.set_auto_wrap_policy(Net())
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy


# --- one-rank prepare -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("minimum", "units"), [(None, [""]), ("200", ["", "blocks.0.lin", "blocks.1.lin"])]
)
def test_size_based_wrap_units_follow_the_minimum(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    minimum: str | None,
    units: list[str],
) -> None:
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    if minimum is not None:
        monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", minimum)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    with caplog.at_level(logging.WARNING, logger="accel.engines.fsdp2"):
        model = accelerator.prepare(Net())
    assert _units(model) == units
    one_unit = [r for r in caplog.records if "min_num_params unset or 0" in r.getMessage()]
    assert len(one_unit) == (1 if minimum is None else 0)
    accelerator.end_training()


class Mixed(nn.Module):
    """A bf16 layer, an fp32 norm and a frozen bf16 layer (an adapter's base weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(BF16)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4).to(BF16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.norm(self.lin(x).float()).to(BF16))


@pytest.mark.parametrize(
    ("precision", "trainable", "scaler"),
    [("bf16", {FP32}, None), ("fp16", {FP32}, torch.amp.GradScaler), ("no", {BF16, FP32}, None)],
)
def test_mixed_precision_makes_trainable_parameters_fp32_master_weights(
    precision: str, trainable: set[torch.dtype], scaler: type | None
) -> None:
    plugin = FullyShardedDataParallelPlugin()
    accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=plugin)
    if precision != "no":  # the policy is on the plugin once the Accelerator exists
        low = {"bf16": BF16, "fp16": FP16}[precision]
        assert plugin.mixed_precision_policy == MixedPrecisionPolicy(low, FP32, FP32)
    assert type(accelerator.scaler) is scaler if scaler else accelerator.scaler is None
    model = accelerator.prepare(Mixed())
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == trainable
    assert {p.dtype for p in model.frozen.parameters()} == {BF16}  # frozen: kept as loaded
    accelerator.end_training()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.o_proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x))


def test_ignored_modules_keep_plain_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_IGNORED_MODULES", r".*\.q_proj$")
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = accelerator.prepare(nn.Sequential(Attention(), Attention()))
    plain = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    assert plain == ["0.q_proj.bias", "0.q_proj.weight", "1.q_proj.bias", "1.q_proj.weight"]
    accelerator.end_training()


def test_an_ignored_modules_pattern_that_matches_nothing_is_refused() -> None:
    plugin = FullyShardedDataParallelPlugin(ignored_modules=r".*\.k_proj$")
    accelerator = Accelerator(fsdp_plugin=plugin)
    with pytest.raises(
        ValueError, match=r"ignored_modules='\.\*\\\\\.k_proj\$'\) matches no module"
    ):
        accelerator.prepare(nn.Sequential(Attention()))
    accelerator.end_training()
