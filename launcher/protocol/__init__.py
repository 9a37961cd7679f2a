"""launcher.protocol: the vocabulary the agent and the in-worker runtime share: recovery plans
and their store keys (plan), the messages on the worker channel (messages), fault kinds and
injection kinds (faults), the restart budget's arithmetic (budget) and the death notice a dying
worker leaves (death_notice). The only launcher code that
`launcher.runtime` may import; it imports nothing from launcher but itself.
"""
