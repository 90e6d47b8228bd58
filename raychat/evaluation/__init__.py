"""nanochat's CORE metric (the DCLM benchmark of in-context-learning tasks) for raychat models.

Owns: the eval bundle on disk (`bundle`: core.yaml, eval_data/*.jsonl, eval_meta_data.csv, loaded
and checked in one place), the scoring rules (`core`: prompt rendering, few-shot sampling, scoring per
task type, the deterministic subsample, centered accuracy, CORE as their mean) and the bundle's
download (`download`, with the `download-eval-bundle` command `python -m raychat.corpus` offers).
The rules follow nanochat's nanochat/core_eval.py and scripts/base_eval.py
(karpathy/nanochat at 92d63d4e8bb4), so a raychat CORE can be compared with a nanochat CORE.
Used by the training loop (raychat.run.core_metric) and by `python -m raychat.evaluate core`.
"""
