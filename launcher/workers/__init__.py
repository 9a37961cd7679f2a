"""launcher.workers: Worker processes on one node: spawning them with torchrun's environment (spawner), their
handles and exits (workers), warm spares and the fork server that makes them (spare, zygote),
adopted grandchildren (adopted) and the agent's end of the worker channel (channel).
"""
