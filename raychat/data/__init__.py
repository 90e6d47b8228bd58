"""The feed of one rank: the cursor that deals corpus units exactly once across failures and resizes,
the best-fit packer of BOS-aligned rows, the Ray Data loader that tokenizes ahead of the step, and the
budget that says how much of the corpus a plan needs.
"""
