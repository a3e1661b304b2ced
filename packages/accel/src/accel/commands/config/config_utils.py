"""Helpers of ``accel config`` (Accelerate's ``accelerate.commands.config.config_utils``).

Accelerate's module holds its interactive prompts (private) and two public names, offered
here: :data:`DYNAMO_BACKENDS`, the ``torch.compile`` backends a config file may name, and
:class:`SubcommandHelpFormatter`, the help layout of the ``config`` subcommands.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from accel_state.enums import DynamoBackend

__all__ = ["DYNAMO_BACKENDS", "SubcommandHelpFormatter"]

#: The backends ``dynamo_config.dynamo_backend`` may name (``NO`` means no compilation).
DYNAMO_BACKENDS: list[str] = [name for name in DynamoBackend.list() if name != "NO"]


class SubcommandHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help for a ``config`` subcommand, without the parent's ``<command> [<args>]`` in usage."""

    def _format_usage(
        self,
        usage: str | None,
        actions: Iterable[argparse.Action],
        groups: Iterable[argparse._MutuallyExclusiveGroup],
        prefix: str | None,
    ) -> str:
        text = super()._format_usage(usage, actions, groups, prefix)
        return text.replace("<command> [<args>] ", "")
