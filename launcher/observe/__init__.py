"""launcher.observe: What people and machines read about a run: console and per-rank logs plus the JSON event
log (logs), the run's timeline built from events (timeline), the node observer and its
Prometheus metrics (observer, metrics), `ftctl status` (status) and `ftctl report` (report).
"""
