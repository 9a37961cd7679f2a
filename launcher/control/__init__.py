"""launcher.control: recovery decisions, made in one place.

The controller (controller: `Controller`, configured by controller_settings) runs on the leader
agent (controller_role: which agent, and the handoff when its node is lost). It takes fault
reports in order (fault_intake), decides each round's strategy (decider over the pure rules of
decision), publishes the plan (plan_publisher), drives the round through its named phases
(round_phase: `RoundPhase`, `RoundTracker`; round_driver: repair, restart-all, dump) and plans
who sends a replacement its state (repair_planning). Beside it: the nodes it knows (node_book),
world changes (world_changes: shrink, scale-up), the history of rounds (fault_history), what a
successor controller inherits (handoff, controller_state), the memory of past UCEs
(fault_memory) and the ranks' progress records for blame (progress).
"""
