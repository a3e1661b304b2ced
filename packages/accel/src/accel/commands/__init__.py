"""Accelerate's ``accelerate.commands``: the command-line tools, as Python functions.

Each module here is a thin layer over accel-launch (``accel_launch``), which implements the
``accel`` command: ``launch``, ``config``, ``env``, ``test``, ``estimate``. ``merge``
(``accel merge-weights``) and ``to_fsdp2`` (``accel to-fsdp2``) are accel's own, offered to the
``accel`` command through the ``accel.commands`` entry points; ``tpu`` keeps its parser and
refuses to run, as XLA is not in this release.
"""
