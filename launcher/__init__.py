"""ftrun's launcher: the `ftrun` and `ftctl` commands and everything they run.

Packages (lower first; tests/test_structure.py keeps the import rules, docs/architecture.md
draws the map): protocol (shared with workers), runtime (inside the workers), observe, hang,
control (recovery decisions), workers (processes on one node), agent (one per node), cli;
config.py turns flags and environment into one typed LaunchConfig.
"""
