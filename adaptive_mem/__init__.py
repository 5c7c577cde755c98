"""adaptive-mem: keep, recompute or swap every activation under a memory budget."""

__version__ = "0.1.0"

__all__ = ["__version__"]
