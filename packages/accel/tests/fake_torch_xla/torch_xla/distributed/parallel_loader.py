"""``torch_xla.distributed.parallel_loader.MpDeviceLoader``: a preloading thread.

Like torch_xla's, the loader is iterated in a background thread that runs ahead of the
consumer by up to ``loader_prefetch_size`` batches (default 8), so bookkeeping done inside
the loader's iteration happens early.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from torch_xla import _fake

_END = object()


class MpDeviceLoader:
    def __init__(self, loader: Any, device: Any, **kwargs: Any) -> None:
        self._loader = loader
        self._device = device
        self._parallel_loader_kwargs = kwargs
        _fake.record("MpDeviceLoader", loader=type(loader).__name__)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        size = int(self._parallel_loader_kwargs.get("loader_prefetch_size", 8))
        batches: queue.Queue[Any] = queue.Queue(maxsize=size)
        failure: list[BaseException] = []

        def work() -> None:
            try:
                for batch in self._loader:
                    batches.put(batch)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                failure.append(error)
            finally:
                batches.put(_END)

        thread = threading.Thread(target=work, name="fake-xla-preloader", daemon=True)
        thread.start()
        try:
            while True:
                batch = batches.get()
                if batch is _END:
                    break
                yield batch
            if failure:
                raise failure[0]
        finally:
            # Unblock and finish the thread when the consumer stops early.
            while thread.is_alive():
                try:
                    batches.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
