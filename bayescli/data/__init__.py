"""Data specs (``--data NAME[:split]``) and in-memory datasets in pixel space."""

from bayescli.data.base import ArrayData
from bayescli.data.registry import DATASETS, DataSpec, load_data, validation_spec

__all__ = ["DATASETS", "ArrayData", "DataSpec", "load_data", "validation_spec"]
