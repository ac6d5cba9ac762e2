"""The coordinator's defaults that the command line shows in its help: here, so that
the parser reads them without importing the coordinator (numpy, torch)."""

from __future__ import annotations

#: steps between two checks whether a plan on the measured speeds pays for moving to it
#: (each check plans within ``replan.CHECK_BUDGET`` of the run's time); 0: never. On since
#: plans are priced on the share of a machine's cores they leave its peers: the README
#: demo's checks then proposed no move (docs/faults.md)
DEFAULT_REBALANCE_EVERY = 25
