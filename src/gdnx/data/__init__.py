"""Training data: the embedded MQAR task and local text files."""

from gdnx.data.source import Batch, make_source

__all__ = ["Batch", "make_source"]
