"""Accelerate's ``accelerate.commands``: the command-line tools, as Python functions.

Each module here is a thin layer over accel-launch (``accel_launch``), which implements the
``accel`` command: ``launch``, ``config``, ``env``, ``test``, ``estimate``. ``merge``
(``accel merge-weights``), ``to_fsdp2`` (``accel to-fsdp2``) and ``tpu`` (``accel tpu-config``)
are accel's own, offered to the ``accel`` command through the ``accel.commands`` entry points.
As Accelerate's, the functions raise for a bad request; the ``accel`` command turns that into
one line and exit code 2.
"""
