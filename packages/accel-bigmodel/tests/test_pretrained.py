"""``load_pretrained`` without transformers: what is checked first, and the missing extra.

The loading itself is tested against real transformers models in
tests-integration/test_load_pretrained.py (the ``upstream`` nox session installs transformers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from accel_bigmodel import load_pretrained


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    save_file({"w": torch.zeros(2)}, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_without_transformers_the_error_names_the_extra(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ImportError) as info:
        load_pretrained(folder)
    assert 'pip install "accel-bigmodel[transformers]"' in str(info.value)
    assert "load_checkpoint_and_dispatch" in str(info.value)  # the way without transformers


def test_a_missing_folder_is_named_with_the_hub_hint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_pretrained("meta-llama/Llama-3.2-1B")
    message = str(info.value)
    assert "'meta-llama/Llama-3.2-1B'" in message and "hf download" in message
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_pretrained(tmp_path / "nowhere")


def test_a_folder_without_config_or_weights_is_named(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(folder)  # checked before transformers is imported
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(folder)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_map": None}, "device_map=None"),
        ({"prefetch_depth": -1}, "prefetch_depth"),
        ({"dtype": "float77"}, "dtype='float77'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_read(
    folder: Path, kwargs: dict[str, object], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # not reached
    with pytest.raises(ValueError, match=match):
        load_pretrained(folder, **kwargs)  # type: ignore[arg-type]
