"""``python -m accel_launch`` is the ``accel`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
