"""A transformers Llama split by its own tensor-parallel plan trains like the whole model.

``apply_tensor_parallel(model, accelerator.torch_device_mesh)`` with no plan takes the model's:
Llama's ``base_model_tp_plan`` (attention projections and MLP split column- and row-wise, the
embedding by vocabulary) under ``model.``, and the head's ``lm_head`` plan. On 2 gloo ranks
(``ParallelismConfig(tp_size=2)``) a tiny ``LlamaForCausalLM`` built from a config must give
the whole model's losses, and after three SGD steps with clipping its weights (one process,
same batches), within ``TOLERANCE`` (SGD, not Adam, which turns float noise in near-zero
gradients into whole steps). Needs transformers; the ``upstream`` nox session installs it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from accel_state.testing import run_on_cpu  # noqa: E402

TOLERANCE = 1e-5  # split matmuls sum their partial products in another order
STEPS = 3


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 12), generator=generator) for _ in range(STEPS)]


def _train(model: Any, optimizer: Any, accelerator: Any = None) -> list[float]:
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(float(loss))
        if accelerator is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _run() -> dict[str, Any]:
    from accel import Accelerator, ParallelismConfig
    from accel.tensor_parallel import model_plan
    from accel.utils import apply_tensor_parallel

    whole = _model()
    reference_losses = _train(whole, torch.optim.SGD(whole.parameters(), lr=0.1))
    reference = {k: v.detach().clone() for k, v in whole.state_dict().items()}

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = _model()
    plan = model_plan(model)
    apply_tensor_parallel(model, accelerator.torch_device_mesh)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = _train(model, optimizer, accelerator)
    state = accelerator.get_state_dict(model)
    result = {
        "plan": plan,
        "q_proj_local": list(q_proj.to_local().shape),
        "losses": [losses, reference_losses],
    }
    if accelerator.is_main_process:
        result["difference"] = max(
            float((state[key].float() - value.float()).abs().max())
            for key, value in reference.items()
        )
        result["keys"] = sorted(state) == sorted(reference)
    accelerator.end_training()
    return result


def test_llama_split_by_its_own_plan_trains_like_the_whole_model() -> None:
    first, second = run_on_cpu(_run, timeout=240)
    assert first["plan"]["model.layers.*.self_attn.q_proj"] == "colwise"
    assert first["plan"]["model.layers.*.mlp.down_proj"] == "rowwise"
    assert first["q_proj_local"] == [16, 32]  # 4 heads x 8 over 2 ranks
    losses, reference = first["losses"]
    assert losses == pytest.approx(reference, abs=TOLERANCE)
    assert second["losses"][0] == pytest.approx(losses, abs=TOLERANCE)
    assert first["keys"] and first["difference"] <= TOLERANCE
