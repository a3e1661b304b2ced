"""accel-amp's accumulation driven by accel-data's prepared loaders (one process).

The window must close on the last batch of every epoch (``sync_with_dataloader``), and exact
normalisation must turn the short last window into exactly the gradient of its batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel_amp import AcceleratedOptimizer, GradientAccumulationPlugin, GradientAccumulator
from accel_data import prepare_data_loader
from accel_state import AcceleratorState, GradientState
from accel_state.testing import clean_state


def _setup(num_steps: int) -> tuple[torch.nn.Linear, AcceleratedOptimizer, GradientAccumulator]:
    AcceleratorState(cpu=True)
    GradientState(GradientAccumulationPlugin(num_steps=num_steps))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, optimizer, GradientAccumulator(optimizers=[optimizer])


def test_window_closes_at_the_end_of_every_epoch() -> None:
    with clean_state():
        model, optimizer, steps = _setup(num_steps=4)
        data = TensorDataset(torch.randn(10, 3, dtype=torch.float64))
        loader = prepare_data_loader(DataLoader(data, batch_size=1), put_on_device=False)
        syncs = []
        for _ in range(2):
            for (x,) in loader:
                with steps.accumulate(model):
                    steps.backward(model(x).sum())
                    syncs.append(steps.sync_gradients)
                    optimizer.step()
                    optimizer.zero_grad()
        expected = [False, False, False, True, False, False, False, True, False, True]
        assert syncs == expected * 2


def test_short_last_window_is_exact_with_num_items() -> None:
    with clean_state():
        model, optimizer, steps = _setup(num_steps=4)
        x = torch.randn(10, 3, dtype=torch.float64)
        y = torch.randn(10, 1, dtype=torch.float64)
        loader = prepare_data_loader(
            DataLoader(TensorDataset(x, y), batch_size=2), put_on_device=False
        )
        reference = torch.nn.Linear(3, 1).double()
        reference.load_state_dict(model.state_dict())
        grads = []
        for xb, yb in loader:
            with steps.accumulate(model):
                loss_sum = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum")
                steps.backward(loss_sum, num_items=len(yb))
                if steps.sync_gradients:
                    grads.append(model.weight.grad.clone())
                optimizer.zero_grad()
        # 5 batches of 2 with num_steps=4: windows of 4 batches (8 rows) and 1 batch (2 rows).
        assert len(grads) == 2
        torch.nn.functional.mse_loss(reference(x[8:]), y[8:]).backward()
        torch.testing.assert_close(grads[1], reference.weight.grad, rtol=1e-12, atol=1e-12)
