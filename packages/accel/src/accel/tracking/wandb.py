"""``WandBTracker``: Weights & Biases runs (``pip install "accel[wandb]"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import on_main_process
from .init_run import InitRunTracker
from .values import check_step, check_values, image_list, require_rows

__all__ = ["WandBTracker"]


class WandBTracker(InitRunTracker):
    """Log to a Weights & Biases run whose project is the run name.

    ``start()`` calls ``wandb.init(project=run_name, **kwargs)``. Offline runs need no
    account: ``init_kwargs={"wandb": {"mode": "offline", "dir": ...}}`` (or
    ``WANDB_MODE=offline``) writes the run under ``<dir>/wandb/offline-run-*`` for a later
    ``wandb sync``.

    Unlike Accelerate's (``main_process_only = False``), the tracker runs on the main process
    only: the other ranks do not start runs of their own.

    Args:
        run_name: The W&B project (``Accelerator.init_trackers``'s ``project_name``).
        **kwargs: Passed to ``wandb.init`` (``mode``, ``dir``, ``name``, ``entity``, ...).

    Raises:
        ImportError: wandb is not installed (the message gives the pip command).
    """

    name = "wandb"
    library = "wandb"

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config (a value set again replaces the old one).

        Raises:
            TypeError: ``values`` is not a dict.
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"the configuration must be a dict of name -> value, got {type(values).__name__}"
            )
        self._run().config.update(dict(values), allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step`` with ``run.log`` (``**kwargs`` go to it, e.g. ``commit``).

        Raises:
            TypeError: ``values`` is not a dict or ``step`` is not an int.
        """
        step = check_step(step)
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a dict of name -> value, got {type(values).__name__}")
        self._run().log(dict(values), step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images keyed by name, each ``wandb.Image`` (numpy arrays, tensors, PIL images).

        Args:
            values: Per name, a list of images (or one image).
            step: The global step, or ``None``.
            **kwargs: Passed to ``run.log``.
        """
        images = {
            key: [self._library.Image(image) for image in image_list(value)]
            for key, value in check_values(values).items()
        }
        self.log(images, step=step, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a ``wandb.Table`` built from ``columns`` and ``data`` rows, or a ``dataframe``.

        Raises:
            ValueError: neither ``data`` nor ``dataframe`` was given.
        """
        require_rows(table_name, data, dataframe)
        table = self._library.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)
