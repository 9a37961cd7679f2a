"""launcher.observe: What people and machines read about a run: console and per-rank logs plus
the JSON event log (logs), the run's timeline built from events (timeline: its records in
run_view, each round's phases and costs in round_phases), the node observer and its Prometheus
metrics (observer, metrics), `ftctl status` (status) and `ftctl report` (report).
"""
