"""rendezvous.store: The TCPStore-wire-compatible key-value store: the wire codec (protocol),
the parallel server (server; its start-up, admission and teardown: loop_host; a connection's
state: connection) and its optional C read path (_quickstore.c), the per-node proxy (proxy),
the in-process store (memory), the client (client), the etcd backend (etcd; reaching etcd:
etcd_channel), token auth (auth), the loop's CPU priority (loop_priority), endpoint parsing
(endpoints) and `ftctl store` (store_cli).
"""
