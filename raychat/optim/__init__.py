"""Muon for the matrices and AdamW for the rest (muon_adamw), the Newton-Schulz update (muon), and how
each rank's share of the optimizer state is cut (shards).
"""
