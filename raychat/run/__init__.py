"""One training run on Ray: the worker's set-up (worker_setup) and step loop (loop), validation
(evaluate), elastic coordination with Ray Train (elastic), metrics for the dashboard and wandb
(metrics), the driver's console (console) and the environment workers get (runtime_env).
"""
