"""`python -m raychat.tokenizer`: the command line of raychat.tokenizer.cli."""

from raychat.common import run_cli
from raychat.tokenizer.cli import main

run_cli(main)
