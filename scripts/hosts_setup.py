"""The benchmarks' shared set-up step: the `/etc/hosts` line torch's store client needs here.

torch's c10d client looks up the reverse DNS name of `::ffff:127.0.0.1`; when more than about 20
clients connect at once and the resolver drops bursts, some stall 5-10 s. The line
`::ffff:127.0.0.1 localhost-v4mapped` removes the stall; without it both sides of every
comparison would be measuring the resolver.
"""

from __future__ import annotations

HOSTS_LINE = "::ffff:127.0.0.1 localhost-v4mapped"


def ensure_hosts_line() -> str:
    """Add the line if missing; return "present", "added" or why it is missing."""
    try:
        with open("/etc/hosts", encoding="utf-8") as f:
            if "localhost-v4mapped" in f.read():
                return "present"
        with open("/etc/hosts", "a", encoding="utf-8") as f:
            f.write("\n" + HOSTS_LINE + "\n")
        return "added"
    except OSError as e:
        return f"missing (could not add: {e.strerror}); numbers include resolver stalls"
