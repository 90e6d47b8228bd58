"""The optimizers a run can train with, behind one interface (base), chosen by --optimizer (registry):
muon_adamw (nanochat's Muon for the matrices and AdamW for the rest: muon_adamw, the Newton-Schulz
update in muon, each rank's share of the state cut by shards) and sgd (plain SGD, momentum optional).

A new optimizer is one module here with a `SPEC` (a raychat.optim.base.OptimizerSpec), plus its name
in raychat.config.OPTIMIZERS and its flags in raychat.config.TrainConfig.
"""
