"""What the installed torch offers: the probes agree with the releases, refusals name them.

These tests run on every torch the suite installs (the pinned one and the floor session's), so
the probes are checked against the release numbers on both sides of each feature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from packaging.version import Version

import accel_state.engine_requests as engine_requests
from accel_state.engine_requests import (
    EngineRequest,
    EngineUnavailableError,
    refuse_unavailable_engines,
)
from accel_state.torch_support import (
    TORCH_FEATURES,
    TORCH_FLOOR,
    TorchFeature,
    TorchTooOldError,
    require_torch,
    torch_has,
)

INSTALLED = Version(Version(torch.__version__).base_version)


@pytest.mark.parametrize("key", sorted(TORCH_FEATURES))
def test_each_probe_agrees_with_the_release_that_brought_the_feature(key: str) -> None:
    feature = TORCH_FEATURES[key]
    assert torch_has(key) is (INSTALLED >= Version(feature.since))


def test_features_are_newer_than_the_floor_and_the_floor_is_installed_or_older() -> None:
    assert all(Version(f.since) > Version(TORCH_FLOOR) for f in TORCH_FEATURES.values())
    assert INSTALLED >= Version(TORCH_FLOOR)


def test_an_unknown_feature_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"torch_has\(feature='fsdp3'\).*dataloader_in_order"):
        torch_has("fsdp3")
    with pytest.raises(ValueError, match="fsdp3"):
        require_torch("fsdp3", "something")


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> Iterator[TorchFeature]:
    """A feature no torch has, registered for one test (and forgotten by the cache after)."""
    feature = TorchFeature("teleport", "9.1", "teleportation (torch.teleport)", lambda: False)
    monkeypatch.setitem(TORCH_FEATURES, feature.key, feature)
    yield feature
    torch_has.cache_clear()


def test_require_torch_names_the_feature_the_release_the_installed_one_and_the_fix(
    missing: TorchFeature,
) -> None:
    feature = missing
    with pytest.raises(TorchTooOldError) as caught:
        require_torch(feature.key, "the teleport engine")
    message = str(caught.value)
    assert message.startswith("the teleport engine needs teleportation (torch.teleport)")
    assert "from 9.1 on" in message and f"this is torch {torch.__version__}" in message
    assert "pip install 'torch>=9.1'" in message
    assert caught.value.feature is feature


def test_an_engine_whose_torch_feature_is_missing_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, missing: TorchFeature
) -> None:
    fsdp = engine_requests.ENGINES["fsdp"]
    assert fsdp.torch_feature == "fully_shard"
    replaced = dataclasses.replace(fsdp, torch_feature=missing.key)
    monkeypatch.setitem(engine_requests.ENGINES, "fsdp", replaced)
    request = EngineRequest("fsdp", "--use_fsdp", "drop --use_fsdp")
    with pytest.raises(EngineUnavailableError) as caught:
        refuse_unavailable_engines([request])
    message = str(caught.value)
    assert "FSDP (fully sharded data parallel) was requested by --use_fsdp" in message
    assert f"from 9.1 on, and this is torch {torch.__version__}" in message
    assert "so nothing was started. Drop --use_fsdp" in message
    assert caught.value.request is request


@pytest.mark.skipif(torch_has("fully_shard"), reason="this torch has FSDP2")
def test_on_a_torch_without_fsdp2_the_fsdp_engine_is_refused_naming_2_6() -> None:
    with pytest.raises(EngineUnavailableError, match=r"from 2\.6 on, and this is torch 2\.5"):
        refuse_unavailable_engines([EngineRequest("fsdp", "--use_fsdp", "drop --use_fsdp")])
