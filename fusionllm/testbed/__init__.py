"""The emulated geo-distributed testbed (``fusionllm testbed``): one network namespace
per peer and one for the coordinator, joined by a bridge, every ordered pair of hosts
shaped to a topology's bandwidth by an ``htb`` class per destination, each pair's
latency added in the send path (``protocol.net.delay``), and the real swarm trained
under each scheduler's plan in turn, measured beside the estimator and the simulator.

``topo`` (the topology, addresses, compute mapping; pure), ``lab`` (namespaces,
bridge, qdiscs), ``plans`` (each scheduler's plan and its predictions), ``swarm``
(the processes of one run), ``report`` (the table and the JSON), ``cmd`` (the command)."""

#: the topologies ``--topology`` knows by name (``topo.PRESETS`` builds them)
PRESET_NAMES = ("two-clusters", "mixed-7", "homes-7", "slow-link", "far-lab")
#: the tiny model the testbed trains unless told (a few ms a micro-batch on one thread)
DEFAULT_MODEL_ARGS = "n_layer=2,n_embd=64,n_head=4"
