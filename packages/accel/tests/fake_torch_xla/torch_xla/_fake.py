"""The machinery of the fake: this process's ordinal, a log of calls, and the exchanges.

Environment:
    FAKE_XLA_ORDINAL, FAKE_XLA_WORLD_SIZE: this process's place (spawn sets them; default a
        single process).
    FAKE_XLA_STORE: the file store the spawned processes exchange through.
    FAKE_XLA_DEVICES: how many processes ``spawn(nprocs=None)`` starts (default 1).
    FAKE_XLA_DEVICE_TYPE: what ``torch_xla.runtime.device_type()`` says (default ``TPU``).
    FAKE_XLA_LOG: a path prefix; each process appends one JSON line per call to
        ``<prefix>.<ordinal>``.
"""

from __future__ import annotations

import json
import os
import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_sequence = [0]
_store: list[Any] = []


def ordinal() -> int:
    return int(os.environ.get("FAKE_XLA_ORDINAL", "0"))


def world_size() -> int:
    return int(os.environ.get("FAKE_XLA_WORLD_SIZE", "1"))


def record(call: str, **details: Any) -> None:
    """Append ``{"call": call, **details}`` to this process's log, when logging."""
    prefix = os.environ.get("FAKE_XLA_LOG")
    if prefix:
        with open(f"{prefix}.{ordinal()}", "a", encoding="utf-8") as log:
            log.write(json.dumps({"call": call, **details}) + "\n")


def _the_store() -> Any:
    if not _store:
        path = os.environ["FAKE_XLA_STORE"]
        _store.append(dist.FileStore(path, world_size()))
        _store[0].set_timeout(timedelta(seconds=120))
    return _store[0]


def exchange(value: Any) -> list[Any]:
    """Every process's ``value``, in ordinal order (each process must call it alike)."""
    if world_size() == 1:
        return [value]
    store = _the_store()
    _sequence[0] += 1
    key = f"exchange/{_sequence[0]}"
    store.set(f"{key}/{ordinal()}", pickle.dumps(value))
    return [pickle.loads(store.get(f"{key}/{rank}")) for rank in range(world_size())]
