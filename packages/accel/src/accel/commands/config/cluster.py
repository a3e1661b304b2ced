"""The local-machine questionnaire (Accelerate's ``accelerate.commands.config.cluster``).

``get_cluster_input()`` asks ``accel config``'s questions on the terminal and returns the
:class:`~accel_launch.config.ClusterConfig` they describe (accel-launch's questionnaire: the
kind of run, processes and machines, DeepSpeed or FSDP2, mixed precision).
"""

from __future__ import annotations

from accel_launch.cli import ask_on_terminal
from accel_launch.config import ClusterConfig, config_from_answers

__all__ = ["get_cluster_input"]


def get_cluster_input() -> ClusterConfig:
    """Ask the questions on the terminal; return the config the answers describe.

    Raises:
        ValueError: an answer is not one of the choices, or the answers describe a launch
            accel would refuse.
        EOFError: the input ended before the last question.
    """
    return config_from_answers(ask_on_terminal)
