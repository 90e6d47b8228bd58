"""Every public command explains itself, and the README documents every training flag."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_error_line

from raychat.common import RaychatError
from raychat.config import TrainConfig, add_config_flags, config_from_args, flag_table

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    ["raychat.train"], ["raychat.plan"], ["raychat.sample"], ["raychat.corpus"], ["raychat.evaluate"],
    ["raychat.evaluate", "core"], ["raychat.export"], ["raychat.corpus", "download-eval-bundle"],
    ["raychat.tokenizer"], ["raychat.report"], ["raychat.status"], ["tune.sweep"], ["tune.report"],
]


# Each command run as `python -m <command> --help` would run it (runpy, a fresh argv), all in one
# interpreter: thirteen interpreters importing torch and Ray cost the unit tier half a minute. Our
# modules are forgotten between commands, so a command that works only after another's imports
# fails here as it would alone.
HELP_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for command in json.loads(sys.argv[1]):
    for name in [m for m in sys.modules if m.split(".")[0] in ("raychat", "tune")]:
        del sys.modules[name]
    sys.argv = [command[0], *command[1:], "--help"]
    buffer, code = io.StringIO(), None
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_module(command[0], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    out[" ".join(command)] = [code, buffer.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    result = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(COMMANDS)], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.integration  # a subprocess
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_help(helps, command):
    code, stdout = helps[" ".join(command)]
    assert code in (0, None), stdout
    assert stdout.startswith("usage:")
    assert len(stdout.splitlines()) > 5  # a description and options, not a bare usage line


@pytest.mark.unit
def test_the_flag_reference_is_the_one_generated_from_the_config():
    """docs/flags.md holds `python -m raychat.config`'s table: a flag added, renamed or re-explained
    in TrainConfig and not in the docs fails here (regenerate the table with that command)."""
    reference = (ROOT / "docs" / "flags.md").read_text()
    assert flag_table() in reference
    table = reference[reference.index("| flag | default"):]
    assert all(f"`--{f.name.replace('_', '-')}`" in table for f in dataclasses.fields(TrainConfig))
    readme = (ROOT / "README.md").read_text()
    assert "docs/flags.md" in readme and len(readme.splitlines()) < 400  # the README fits; docs/ has more


@pytest.mark.unit
def test_readme_starts_with_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = 'pip install -e ".[dev]" && python -m pytest -q'
    assert test_command in ci
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert test_command in first_block
    assert "python -m raychat.train" in first_block


FLOAT_FLAGS = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)
               if isinstance(f.default, float)]


@pytest.mark.unit
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_flag_refuses_a_value_that_is_not_finite(value):
    """argparse's float() takes them, and each passes comparisons a number would fail (nan) or breaks
    the arithmetic it feeds long after the start (inf)."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert "--max-lost-minutes" in FLOAT_FLAGS and "--target-flops" in FLOAT_FLAGS
    for flag in FLOAT_FLAGS:
        with pytest.raises(RaychatError, match=f"^{flag} must be a finite number, got {value}$"):
            config_from_args(parser.parse_args([f"{flag}={value}"]))


@pytest.mark.integration  # commands in a reused interpreter
def test_train_refuses_a_float_flag_that_is_not_finite_in_one_line(commands, tmp_path):
    """Through the command: before anything runs (the missing eval bundle's refusal, which comes after
    every earlier check, is what a value let through would meet here instead of a run)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAYCHAT_OFFLINE": "1"}
    for flag, value in (("--max-lost-minutes", "nan"), ("--target-flops", "inf")):
        result = commands.run("raychat.train", f"{flag}={value}", "--eval-bundle", tmp_path / "none",
                              env=env, timeout=120)
        assert one_error_line(result) == f"raychat: error: {flag} must be a finite number, got {value}"
