"""What `pip install .` puts on a node is what raychat imports: every third-party module that raychat/
and tune/ import is a declared dependency of the project (or of the extra that the importing module
needs), not something that happens to come with Ray, nor one of `dev`'s test tools. (A fresh virtualenv
would need the package indexes: the tests stay on this machine.)"""

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

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
