"""rendezvous.nodes: Node-level rendezvous on top of a store: membership (join, generations,
leave; joining the world: joining; replacements and hot spares: replacing), node liveness
(liveness/), the controller election (election), rounds and the world they form (rounds,
world), the store's key layout (keys), rendezvous and membership settings (settings),
interruptible waits (waits) and who hosts the embedded store (hosting).
"""
