"""Accelerate's ``accelerate.commands``: the command-line tools, as Python functions.

Each module here is a thin layer over accel-launch (``accel_launch``), which implements the
``accel`` command: ``launch``, ``config``, ``env``, ``test``, ``estimate``. ``to_fsdp2``,
``merge`` and ``tpu`` keep their parsers and refuse to run, as their engines are not in this
release.
"""
