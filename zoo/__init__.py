"""The built-in models and data, on the ground floor: they import only torch and
numpy (and may import ``protocol``; preparing token shards imports ``tokenizers``
or ``tiktoken`` when asked for). A job names them by ``MODULE:FUNC`` spec or by the short
names of ``protocol.model.job.BUILTIN_MODELS`` and ``BUILTIN_DATA``; the planner's
workload shapes (``coordinator.workloads``) build on them."""
