"""launcher.hang: Finding hangs: heartbeat and progress silence (hang_watch), process states read
from /proc (proc_watch) and stack dumps of a hung rank (stacks).
"""
