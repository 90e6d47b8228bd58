"""Sweeps over depth and training horizon with Ray Tune (`python -m tune.sweep`) and their analysis
(`python -m tune.report`): which model size is compute-optimal, and at what tokens:params ratio."""
