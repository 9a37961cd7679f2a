"""ftrun's rendezvous layer, below the launcher: the key-value interface (kv), its errors
(errors), the TCPStore-compatible store and its backends (store/) and node-level rendezvous on
top of a store (nodes/). Imports nothing from launcher.
"""
