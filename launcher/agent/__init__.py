"""launcher.agent: The node agent: one per node, supervising its local workers through a job.
It joins the rendezvous (store_stack), enters the world (world_parts), starts the workers,
classifies their exits (exit_verdict, worker_exits, errors), hears them (worker_messages) and
the other nodes (membership_news), reports faults (fault_reports), executes the controller's
plans (plan_executor), guards against hangs (hang_guard) and ends the job cleanly (exit_guard).
Its phase and the state its parts share: agent_state.
"""
