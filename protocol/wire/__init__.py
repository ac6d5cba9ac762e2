"""What crosses between processes: value encoding, codecs, messages, signed envelopes.

Importing any part of ``protocol.wire`` registers every message kind: the classes of
``messages`` and those of the modules below (``messages.py`` is at its size limit, and
a module it imported back would close an import cycle)."""

from protocol.wire import link_probes as link_probes  # noqa: F401  (registers ProbeLink, ProbeResult)
from protocol.wire import reassign as reassign  # noqa: F401  (registers Reassign, Resend)
