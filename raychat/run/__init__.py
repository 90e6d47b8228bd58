"""One training run on Ray: the worker's set-up (worker_setup) and step loop (loop), one optimizer
step in plain PyTorch (step), validation (evaluate), elastic coordination with Ray Train (elastic),
metrics for the dashboard and wandb (metrics), the checkpoint cadence (cadence), where the run's
time went (ledger), the driver's console (console), the environment workers get (runtime_env) and
the private Ray APIs all of it uses (ray_internals).
"""
