"""The accel path for a transformers model, as README.md and the accel-bigmodel docs give it.

transformers looks for the ``accelerate`` distribution by name: without it,
``from_pretrained(device_map=...)`` refuses. With accel the same model is built on the meta
device from its config and dispatched from the folder ``save_pretrained`` wrote. A real
(tiny) GPT-2 saved to a local folder must give the original model's logits, on the CPU and
with a block offloaded to disk. Needs transformers; the ``upstream`` nox session installs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from accel import init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2-tiny")
    model.save_pretrained(folder)
    return folder, model


def _accel_model(folder: Path, **dispatch: object) -> torch.nn.Module:
    # The recipe of the docs, line for line.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    model = load_checkpoint_and_dispatch(
        model, folder, no_split_module_classes=["GPT2Block"], **dispatch
    )
    return model.eval()


@pytest.mark.parametrize(
    "dispatch",
    [
        {"device_map": "auto"},
        {
            "device_map": {
                "transformer.wte": "cpu",
                "transformer.wpe": "cpu",
                "transformer.h.0": "cpu",
                "transformer.h.1": "disk",
                "transformer.ln_f": "cpu",
                "lm_head": "cpu",
            }
        },
    ],
    ids=["auto", "cpu+disk"],
)
def test_a_saved_transformers_model_gives_its_logits_through_accel(
    saved: tuple[Path, torch.nn.Module], dispatch: dict[str, object], tmp_path: Path
) -> None:
    folder, original = saved
    model = _accel_model(folder, offload_folder=str(tmp_path / "offload"), **dispatch)
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, original(tokens).logits)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is not None,
    reason="Accelerate is installed here, so transformers uses it",
)
def test_transformers_device_map_needs_the_accelerate_distribution(
    saved: tuple[Path, torch.nn.Module],
) -> None:
    folder, _ = saved
    with pytest.raises((ImportError, ValueError), match="accelerate"):
        transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
