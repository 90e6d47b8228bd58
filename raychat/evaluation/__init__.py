"""How well a model does: validation bits per byte (`bpb`) and nanochat's CORE metric (the DCLM
benchmark of in-context-learning tasks).

For CORE it owns: the eval bundle on disk (`bundle`: core.yaml, eval_data/*.jsonl,
eval_meta_data.csv, loaded and checked in one place), the scoring rules (`core`: prompt rendering,
few-shot sampling, scoring per task type, the deterministic subsample, centered accuracy, CORE as
their mean) and the bundle's download and the driver's check that it is there (`download`, with the
`download-eval-bundle` command `python -m raychat.corpus` offers).
The rules follow nanochat's nanochat/core_eval.py and scripts/base_eval.py
(karpathy/nanochat at 92d63d4e8bb4), so a raychat CORE can be compared with a nanochat CORE.
Used by the training loop (raychat.worker.core_metric) and by `python -m raychat.evaluate core`.
"""
