"""The BPE tokenizer: training it on the corpus (train), loading and encoding with it (core), measuring
its compression (stats), nanochat's tokenizer imported (nanochat), a tokenizer in a bucket cached per
node (remote). `python -m raychat.tokenizer` is the command line (cli, run by __main__).
"""
