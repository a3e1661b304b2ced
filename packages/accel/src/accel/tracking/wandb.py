"""``WandBTracker``: Weights & Biases runs (``pip install "accel[wandb]"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, image_list

__all__ = ["WandBTracker"]


def _wandb() -> Any:
    return import_library("wandb", "WandBTracker", "wandb")


class WandBTracker(GeneralTracker):
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
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._wandb = _wandb()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The ``wandb`` run (``None`` before ``start()`` and after ``finish()``)."""
        return self.run

    def _run(self) -> Any:
        if self.run is None:
            self.run = self._wandb.init(project=self.run_name, **self.init_kwargs)
        return self.run

    @on_main_process
    def start(self) -> None:
        """Start the run (``wandb.init``)."""
        self._run()

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
            key: [self._wandb.Image(image) for image in image_list(value)]
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
        if data is None and dataframe is None:
            raise ValueError(
                f"log_table({table_name!r}) needs rows: pass data=[[...], ...] (with columns=...) "
                "or dataframe=..."
            )
        table = self._wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run (a later call starts a new one)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
