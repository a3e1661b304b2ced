"""``write_safetensors`` writes exactly the bytes ``safetensors.torch.save_file`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from accel_state.safetensors_writer import write_safetensors

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
# torch 2.7 added the e8m0 scale type; on the floor (2.5) the writer simply has no such dtype.
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES.append(torch.float8_e8m0fnu)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    if dtype == torch.complex64:
        return torch.complex(values, -values)
    return values.to(dtype)


# One key: safetensors keeps the metadata in a hash map, so with several keys its own order
# changes from one run to the next (any order loads).
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"note": "é"}])
def test_the_bytes_equal_safetensors_for_every_dtype_shape_and_name(
    tmp_path: Path, metadata: dict[str, str] | None
) -> None:
    shapes = [(3, 5), (0,), (), (7,), (2, 3, 4)]
    tensors = {}
    for index, dtype in enumerate(DTYPES):
        for offset, shape in enumerate(shapes[: 1 + index % len(shapes)]):
            name = f"{'zyx'[index % 3]}.layer{index}.{offset}.ü"
            tensors[name] = _tensor(dtype, shape, index * 10 + offset)
    save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "reference.safetensors").read_bytes()
    loaded = load_file(tmp_path / "ours.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert (
            loaded[name].reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8))
        )


def test_an_empty_dict_and_a_large_tensor_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accel_state.safetensors_writer as writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 1000)  # many partial writes
    big = {"w": torch.arange(10_000, dtype=torch.float32)}
    for name, tensors in (("empty", {}), ("big", big)):
        save_file(tensors, tmp_path / f"{name}-ref.safetensors")
        write_safetensors(tmp_path / f"{name}.safetensors", tensors)
        assert (tmp_path / f"{name}.safetensors").read_bytes() == (
            tmp_path / f"{name}-ref.safetensors"
        ).read_bytes()


def test_bad_tensors_are_refused_naming_them_and_nothing_is_written(tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=r"'t' is not contiguous.*contiguous\(\)"):
        write_safetensors(target, {"t": torch.zeros(3, 4).t()})
    with pytest.raises(ValueError, match=r"'h' has dtype torch.complex128"):
        write_safetensors(target, {"h": torch.zeros(2, dtype=torch.complex128)})
    assert not target.exists()
