"""The feed of one rank: the cursor that deals corpus units exactly once across failures and resizes,
the best-fit packer of BOS-aligned rows, the Ray Data loader that tokenizes ahead of the step, and the
budget that says how much of the corpus a plan needs.

    cursor      which units each rank reads; the small record any number of ranks resume from
    packer      BOS-aligned best-fit packing into rows
    loader      Ray Data reads and tokenizes, the rank packs: TrainLoader
    validation  the run's fixed validation rows, read and packed in the rank's own process
    budget      tokens the plan trains on against tokens the corpus holds
"""
