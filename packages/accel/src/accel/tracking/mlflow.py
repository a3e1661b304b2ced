"""``MLflowTracker``: MLflow runs (``pip install "accel[mlflow]"``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .base import GeneralTracker, import_library, on_main_process, warn
from .values import (
    check_step,
    check_values,
    image_array,
    image_list,
    jsonable,
    numbers_only,
    require_rows,
)

__all__ = ["MLflowTracker"]


def _mlflow() -> Any:
    return import_library("mlflow", "MLflowTracker", "mlflow")


def _env_bool(name: str, default: bool) -> bool:
    text = os.environ.get(name)
    if text is None:
        return default
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on", "y", "t"}:
        return True
    if lowered in {"0", "false", "no", "off", "n", "f", ""}:
        return False
    raise ValueError(f"{name}={text!r} is not a boolean: set it to 1/true/yes or 0/false/no")


class MLflowTracker(GeneralTracker):
    """Log to an MLflow run in the experiment named after the project.

    The store is MLflow's: ``tracking_uri=`` (or ``MLFLOW_TRACKING_URI``, or
    ``mlflow.set_tracking_uri``) picks it, e.g. ``"sqlite:///runs/mlflow.db"`` or a server URL.
    ``start()`` finds or creates the experiment and starts the run with MLflow's fluent API,
    so ``mlflow.log_*`` calls of the training script land in the same run.

    Environment variables take precedence over the arguments, as in Accelerate:
    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (a JSON dict) and
    ``MLFLOW_NESTED_RUN``.

    Args:
        experiment_name: The experiment (``init_trackers``'s ``project_name``).
        logging_dir: The artifact location of a newly created experiment.
        run_id: Resume this run instead of starting a new one.
        tags: Tags of the run (and of a new experiment), a dict or its JSON text.
        nested_run: Start the run nested under the active one.
        run_name: Name of a new run.
        description: The run's description.
        tracking_uri: The tracking store (``mlflow.set_tracking_uri``) before starting.

    Raises:
        ImportError: MLflow is not installed (the message gives the pip command).
        ValueError: ``tags`` (or ``MLFLOW_TAGS``) is not a JSON dict, or ``MLFLOW_NESTED_RUN``
            is not a boolean.
    """

    name = "mlflow"
    requires_logging_directory = False
    main_process_only = True

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        tracking_uri: str | None = None,
    ) -> None:
        super().__init__()
        self._mlflow = _mlflow()
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = _tags(os.environ.get("MLFLOW_TAGS", tags))
        self.nested_run = _env_bool("MLFLOW_NESTED_RUN", bool(nested_run))
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run: Any = None
        self._skipped: set[str] = set()

    @property
    def tracker(self) -> Any:
        """The active ``mlflow.ActiveRun`` (``None`` before ``start()``)."""
        return self.active_run

    @on_main_process
    def start(self) -> None:
        """Find or create the experiment and start (or resume) the run."""
        mlflow = self._mlflow
        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        experiment_id = None
        if self.experiment_name is not None:
            experiment = mlflow.get_experiment_by_name(self.experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                experiment_id = mlflow.create_experiment(
                    self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
                )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as run parameters (MLflow stores their text).

        A value whose text is longer than MLflow's limit is left out with a warning naming it.
        """
        limits = self._mlflow.utils.validation
        params: dict[str, Any] = {}
        for key, value in check_values(values, "the configuration").items():
            plain = jsonable(value, repr(key))
            text = plain if isinstance(plain, str) else str(plain)
            if len(text) > limits.MAX_PARAM_VAL_LENGTH:
                warn(
                    f"MLflowTracker: the parameter {key!r} is {len(text)} characters long, over "
                    f"MLflow's limit of {limits.MAX_PARAM_VAL_LENGTH}; it is left out (log it as "
                    "an artifact instead: tracker.log_dict or mlflow.log_text)"
                )
                continue
            params[key] = text
        items = list(params.items())
        batch = limits.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(items), batch):
            self._mlflow.log_params(dict(items[start : start + batch]))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers in ``values`` as metrics at ``step`` (``mlflow.log_metrics``).

        MLflow's metrics are numbers: any other value is left out, with a warning naming its
        key the first time.
        """
        step = check_step(step)
        metrics = numbers_only(
            check_values(values),
            "MLflowTracker",
            self._skipped,
            "log text with mlflow.set_tag or tracker.log_dict",
        )
        if metrics:
            self._mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images with ``mlflow.log_image(image, key=name, step=step)``.

        Args:
            values: Per name, a list of images (or one): numpy arrays, tensors, PIL images.
            step: The global step (``0`` when ``None``, MLflow's default).
            **kwargs: Passed to ``mlflow.log_image`` (e.g. ``synchronous``).
        """
        step = check_step(step)
        for key, images in check_values(values).items():
            for image in image_list(images):
                self._mlflow.log_image(image_array(image), key=key, step=step or 0, **kwargs)

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
        """Log a table as the artifact ``<table_name>.json`` (pandas' "split" layout)."""
        if dataframe is not None:
            columns = [str(column) for column in dataframe.columns]
            data = dataframe.values.tolist()
        require_rows(table_name, data, dataframe)
        if columns is None:
            columns = [str(index) for index in range(len(data[0]) if data else 0)]
        table = {"columns": list(columns), "data": jsonable(data, table_name)}
        suffix = "" if step is None else f"_step{step}"
        self._mlflow.log_dict(table, f"{table_name}{suffix}.json", **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Log a matplotlib or plotly figure (``mlflow.log_figure``)."""
        self._mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Copy a file into the run's artifacts (``mlflow.log_artifact``)."""
        self._mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Copy a directory's files into the run's artifacts (``mlflow.log_artifacts``)."""
        self._mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        """End the run started by ``start()``."""
        if self.active_run is not None:
            self._mlflow.end_run()
            self.active_run = None


def _tags(tags: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    if tags is None:
        return None
    if isinstance(tags, str):
        try:
            tags = json.loads(tags)
        except json.JSONDecodeError as error:
            raise ValueError(f"MLflow tags {tags!r} are not JSON: give a dict") from error
    if not isinstance(tags, Mapping):
        raise ValueError(f"MLflow tags must be a dict of name -> value, got {tags!r}")
    return dict(tags)
