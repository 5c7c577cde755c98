"""The closed loop behind --adaptive-memory-optimization: measure, search, apply, cache."""
