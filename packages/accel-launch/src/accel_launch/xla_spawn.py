"""``accel launch --tpu``: start a script's training function on every XLA device.

``python -m accel_launch.xla_spawn [--nprocs 1] [--module] FUNCTION SCRIPT [ARGS...]`` imports
SCRIPT (a file, or a module with ``--module``), checks that it defines FUNCTION, and hands it
to ``torch_xla.distributed.xla_multiprocessing.spawn``, which starts one process per XLA
device and calls FUNCTION() in each (the process index is dropped: the script reads its rank
from ``Accelerator().process_index``), as Accelerate's TPU launcher does. ``sys.argv`` is the
script's own in every process.

torch_xla decides how many processes run (every local device); ``--nprocs 1`` runs one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accel_state.imports import is_torch_xla_available

__all__ = ["TrainingFunction", "main"]


class TrainingFunction:
    """The script's training function, picklable by name for ``xmp.spawn``.

    Args:
        module: The script's module name.
        function: The function's name in it.
        argv: ``sys.argv`` the script sees.
    """

    def __init__(self, module: str, function: str, argv: list[str]) -> None:
        self.module = module
        self.function = function
        self.argv = argv

    def __call__(self, index: int, *args: Any) -> None:
        """Run the function in process ``index`` (torch_xla passes the index first)."""
        sys.argv = list(self.argv)
        getattr(importlib.import_module(self.module), self.function)(*args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel launch --tpu")
    parser.add_argument("--nprocs", type=int, default=None)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("function")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Import the script and spawn its training function; return the exit code."""
    args = _parser().parse_args(argv)
    if not is_torch_xla_available():
        print(
            "accel launch --tpu: torch_xla is not installed (or USE_TORCH_XLA=false), so "
            "there is no XLA device to start the script on; nothing was started. Install "
            "torch_xla for your torch release, or drop --tpu (distributed_type: XLA in a "
            "config file) to train on CPU or GPU processes",
            file=sys.stderr,
        )
        return 2
    if args.module:
        module_name, path = args.script, args.script
    else:
        script = Path(args.script).resolve()
        sys.path.insert(0, str(script.parent))
        module_name, path = script.stem, str(script)
    module = importlib.import_module(module_name)
    if not callable(getattr(module, args.function, None)):
        print(
            f"accel launch --tpu: {path} has no function {args.function!r} to start on each "
            "XLA device; define it (under `if __name__ == '__main__':` nothing runs here) or "
            "pass --main_training_function NAME",
            file=sys.stderr,
        )
        return 2
    xmp = importlib.import_module("torch_xla.distributed.xla_multiprocessing")
    function = TrainingFunction(module_name, args.function, [path, *args.script_args])
    try:
        xmp.spawn(function, args=(), nprocs=args.nprocs)
    except Exception as error:  # noqa: BLE001 - a process failed; its traceback is printed
        print(f"accel launch --tpu: the run failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
