"""How often spot checks run unless told, apart from ``spotcheck`` (which needs
torch), so that the command line parses ``--spot-check`` without importing it."""

#: the chance that a micro-batch of a replicated stage is re-executed (``--spot-check``)
DEFAULT_SPOT_CHECK = 0.05
