"""``torch_xla.runtime``: the world size, the ordinals and the device type."""

from __future__ import annotations

import os

from . import _fake


def world_size() -> int:
    return _fake.world_size()


def global_ordinal() -> int:
    return _fake.ordinal()


def local_ordinal() -> int:
    return _fake.ordinal()


def local_device_count() -> int:
    return _fake.world_size()


def device_type() -> str:
    return os.environ.get("FAKE_XLA_DEVICE_TYPE", "TPU")
