"""launcher.agent: The node agent: one per node, supervising its local workers through a job. It joins the
rendezvous (store_stack), starts the workers, classifies their exits (errors), reports faults
(fault_reports), executes the controller's plans (plan_executor), guards against hangs
(hang_guard) and ends the job cleanly (exit_guard).
"""
