"""rendezvous.nodes: Node-level rendezvous on top of a store: membership (join, generations, leave), node
liveness (liveness/), the controller election (election), rounds and the world they form
(rounds, world), the store's key layout (keys), rendezvous settings (settings), interruptible
waits (waits) and who hosts the embedded store (hosting).
"""
