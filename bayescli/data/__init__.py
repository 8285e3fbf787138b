"""Data specs (``--data NAME[:split]``) and lazy datasets in pixel space, read batch by batch."""

from bayescli.data.base import ArrayData, Data
from bayescli.data.registry import DATASETS, DataSpec, load_data, validation_spec

__all__ = ["DATASETS", "ArrayData", "Data", "DataSpec", "load_data", "validation_spec"]
