"""launcher.control: Recovery decisions, made in one place: the controller on the leader agent
collects fault reports, decides the round's strategy (decision), plans who restarts and who sends
state to whom, and publishes the plan; its durable state (controller_state), its election role
(controller_role), the memory of past faults (fault_memory) and the ranks' progress (progress).
"""
