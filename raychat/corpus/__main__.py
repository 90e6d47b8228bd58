"""`python -m raychat.corpus`: the command line of raychat.corpus.cli."""

from raychat.common import run_cli
from raychat.corpus.cli import main

run_cli(main)
