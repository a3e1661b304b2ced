"""Version of the accel-launch distribution (read by hatch at build time)."""

__version__ = "0.1.0"
