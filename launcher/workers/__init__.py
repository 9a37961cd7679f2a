"""launcher.workers: Worker processes on one node: spawning them with torchrun's environment
(spawner), their handles and exits (workers), the process calls every child needs (prctl),
warm spares: the agent's pool (spare) and its handle on the fork server (fork_server), what runs
inside a spare (spare_process) and inside the fork server (spare_server), their CPU priority
(priority); adopted grandchildren (adopted) and the agent's end of the worker channel (channel).
"""
