"""The built-in models and data, on the ground floor: they import only torch (and
may import ``protocol``). A job names them by ``MODULE:FUNC`` spec or by the short
names of ``protocol.model.job.BUILTIN_MODELS`` and ``BUILTIN_DATA``; the planner's
workload shapes (``coordinator.workloads``) build on them."""
