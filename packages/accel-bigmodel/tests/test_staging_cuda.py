"""The offload engine's GPU staging on a real CUDA device (skipped elsewhere).

``tools/gpu_check.py`` runs these with ``pytest -m gpu``. Every mode must give outputs equal
to the model resident on the GPU; ``auto`` must copy CPU-resident weights straight from
page-locked memory (unless the driver refuses, which the report then names), ``ring`` never.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel.dispatch import dispatch_model, load_checkpoint_and_dispatch
from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.hooks import find_align_devices_hook, remove_hook_from_submodules
from accel_bigmodel.prefetch import PrefetchingMaterializer, host_pinning
from accel_bigmodel.prefetch.copy_api import CudaCopyApi

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 256, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


DEVICE_MAP = {
    "embed": 0,
    "layers.0": "cpu",
    "layers.1": "cpu",
    "layers.2": "disk",
    "layers.3": "cpu",
    "layers.4": "disk",
    "layers.5": 0,
    "head": 0,
}
IDS = torch.arange(24).reshape(2, 12) % 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, torch.Tensor]]:
    torch.manual_seed(0)
    model = Decoder().eval()
    folder = tmp_path_factory.mktemp("staging-cuda")
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    with torch.no_grad():
        expected = model.cuda()(IDS.cuda()).cpu()
    yield folder, expected


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    yield
    assert not host_pinning._TAKEN, "page-locked ranges outlived their engine"


def _engine(model: nn.Module) -> PrefetchingMaterializer:
    for module in model.modules():
        hook = find_align_devices_hook(module)
        if hook is not None and isinstance(hook.materializer, PrefetchingMaterializer):
            return hook.materializer
    raise AssertionError("no prefetching engine")


@pytest.mark.parametrize("staging", ["auto", "register", "ring"])
@pytest.mark.parametrize("depth", [1, 2])
def test_every_staging_mode_matches_the_resident_model(
    checkpoint: tuple[Path, torch.Tensor],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    staging: str,
    depth: int,
) -> None:
    folder, expected = checkpoint
    monkeypatch.setenv("ACCEL_OFFLOAD_STAGING", staging)
    with init_empty_weights():
        empty = Decoder()
    model = load_checkpoint_and_dispatch(
        empty.eval(), folder, DEVICE_MAP, offload_folder=tmp_path, prefetch_depth=depth
    )
    engine = _engine(model)
    with torch.no_grad():
        outputs = [model(IDS.cuda()).cpu() for _ in range(3)]
    torch.cuda.synchronize()
    for output in outputs:
        assert torch.equal(output, expected)
    report = engine.staging_report()
    assert report["mode"] == staging
    assert report["ring_bytes"] > 0  # the disk blocks always take the ring
    if staging == "ring":
        assert report["direct_bytes"] == 0 and report["registered_bytes"] == 0
    elif not report["registration_refused"]:
        assert report["direct_bytes"] > 0 and report["registered_bytes"] > 0
    remove_hook_from_submodules(model)  # closes the engine: copies waited for, ranges released
    assert not host_pinning._TAKEN


def test_registration_pins_a_file_map_in_place(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1 << 20)}, str(path), {"format": "pt"})
    from accel_bigmodel.safetensors_files import SafetensorsFile

    handle = SafetensorsFile(str(path))
    view = handle.view("w")
    api = CudaCopyApi()
    page = 4096
    start = view.data_ptr() - view.data_ptr() % page
    end = view.data_ptr() + view.numel() * 4
    end += -end % page
    code = api.register(start, end - start, torch.device("cuda", 0))
    if code != 0:
        pytest.skip(f"this driver refuses read-only registration: {api.error_name(code)}")
    try:
        assert view.is_pinned()
        target = torch.empty_like(view, device="cuda")
        target.copy_(view, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(target.cpu(), view)
    finally:
        assert api.unregister(start) == 0
    assert not view.is_pinned()
    handle.close()


def test_a_deep_copy_of_a_model_with_cpu_blocks_beside_the_gpu_runs() -> None:
    # Accelerate's test_dispatch_model_copy, with an offloaded CPU block.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).eval()
    x = torch.randn(2, 3)
    expected = model(x)
    dispatch_model(model, {"0": 0, "1": "cpu", "2": 0})
    clone = copy.deepcopy(model)
    assert clone[0].forward is not model[0].forward
    torch.testing.assert_close(clone(x).cpu(), expected)
    torch.testing.assert_close(model(x).cpu(), expected)
