"""The BPE tokenizer: training it on the corpus (train), loading and encoding with it (core), measuring
its compression (evaluate). `python -m raychat.tokenizer` is the command line (cli).
"""
