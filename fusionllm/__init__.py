"""FusionLLM: decentralized training over volunteers' GPUs (the command line and built-ins)."""

__version__ = "0.1.0"
