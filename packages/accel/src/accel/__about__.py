"""Version of the accel distribution (read by hatch at build time)."""

__version__ = "0.1.0"
