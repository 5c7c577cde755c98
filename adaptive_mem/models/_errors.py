"""The error of model specs (``--model SPEC``), shared by the spec parser and the model builders."""

__all__ = ["ModelSpecError"]


class ModelSpecError(ValueError):
    """A model spec, its arguments or the model it builds is not usable."""
