"""A private swarm's DHT rule (a hivemind record validator on every node of the swarm)."""

from __future__ import annotations

import math

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol.trust.admission import check_certificate
from protocol.trust.identity import check_record, key_hex
from protocol.wire.messages import dht_key


class RunRecords(RecordValidatorBase):
    """A private swarm's DHT rule, on every node of the swarm: the run's coordinator
    record must be signed by the coordinator's key, and each advert by a peer whose
    admission certificate (in the advert) that coordinator signed for its key. An
    outsider's records for the run are not stored, and a node's answer holding one
    is not believed. (Expiry is the coordinator's business, not the DHT's: a record
    stored while valid must stay readable.)"""

    def __init__(self, run: str, coordinator_key: str) -> None:
        super().__init__()
        self.run, self.coordinator_key = run, coordinator_key
        self._adverts = DHTID.generate(source=dht_key(run, "adverts")).to_bytes()
        self._coordinator = DHTID.generate(source=dht_key(run, "coordinator")).to_bytes()
        self.dropped = 0

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._adverts, self._coordinator):
            return True  # another run's, or not FusionLLM's
        try:
            value = MSGPackSerializer.loads(record.value)
            signer = key_hex(check_record(value))
            if record.key == self._coordinator:
                ok = signer == self.coordinator_key
            else:
                cert = check_certificate(value.get("cert"), self.coordinator_key, self.run, -math.inf)
                subkey = MSGPackSerializer.loads(record.subkey)
                ok = cert["subject"] == signer and cert["peer_id"] == value.get("peer_id") == subkey
        except Exception:  # anything unreadable is not the run's
            ok = False
        self.dropped += not ok
        return ok
