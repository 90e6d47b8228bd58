"""What `pip install .` puts on a node is what raychat imports: every third-party module that raychat/
and tune/ import is a declared dependency of the project (or of the extra that the importing module
needs), not something that happens to come with Ray; and a fresh virtualenv with `pip install .` and no
extras can start training."""

import ast
import os
import re
import subprocess
import sys
import time
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# Modules only an extra's feature imports: the import is reached only with that feature on.
EXTRA_ONLY = {"torchao": "fp8"}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> the files of raychat/ and tune/ that import it."""
    local = {"raychat", "tune"}
    found: dict[str, set[str]] = {}
    for path in [*REPO.glob("raychat/**/*.py"), *REPO.glob("tune/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_module_raychat_imports_is_a_declared_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs}
              for name, reqs in project["optional-dependencies"].items()}
    distributions = packages_distributions()
    missing = []
    for module, files in sorted(_imported_modules().items()):
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        wanted = extras[EXTRA_ONLY[module]] if module in EXTRA_ONLY else declared
        if not names & wanted:
            missing.append(f"{module} ({', '.join(sorted(names))}; imported by {', '.join(sorted(files))})")
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)


@pytest.mark.slow
def test_a_fresh_virtualenv_with_pip_install_dot_can_train(tmp_path):
    """`pip install .` (no extras) into a plain virtualenv, from the package indexes pip is set up with:
    the driver's and the workers' modules import there, `python -m raychat.train` starts, and nothing of
    `dev` (pytest) came with it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(REPO)], capture_output=True,
                             text=True, timeout=900, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    print(f"pip install . into a fresh virtualenv: {time.monotonic() - started:.0f}s")
    code = ("import importlib.util, raychat.train, raychat.run.driver, raychat.run.loop, tune.sweep\n"
            "print(importlib.util.find_spec('pytest') is None)")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"  # nothing from `dev`
    cli = subprocess.run([python, "-m", "raychat.train", "--help"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert cli.returncode == 0 and "--depth" in cli.stdout, cli.stderr[-3000:]
