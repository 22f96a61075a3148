"""gpuforge: configure and image GPU clusters on AWS."""

__version__ = "0.1.0"
