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

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# Modules only an extra's feature imports: the import is reached only with that feature on.
EXTRA_ONLY = {"torchao": "fp8", "huggingface_hub": "hub", "matplotlib": "report", "google": "gcs",
              "requests": "gcs"}


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


@pytest.mark.unit
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


# A node without the extras: None in sys.modules is how Python reads a module that cannot be imported
# (an import raises ModuleNotFoundError, importlib.util.find_spec answers None), as where not installed.
WITHOUT_EXTRAS = """
import sys
sys.modules["matplotlib"] = sys.modules["huggingface_hub"] = sys.modules["google.cloud.storage"] = None
"""


@pytest.mark.integration  # a Python of its own, without the extras
def test_a_node_without_the_extras_trains_and_is_told_what_to_install(tmp_path):
    """`pip install .` (no extras) must train: the trainer, its workers' loop, the corpus and the sweep
    import neither the Hub's client, matplotlib nor the GCS client; the embedded default corpus falls
    back to the offline sample corpus with a line naming the extra; a report and a gs:// location ask
    for their extras in one line."""
    import subprocess

    code = WITHOUT_EXTRAS + """
import raychat.train, raychat.worker.loop, raychat.run.driver, raychat.corpus.cli, tune.sweep, tune.report
import raychat.report.__main__
from raychat.common import RaychatError
from raychat.corpus.default import prepare_default_corpus
from raychat.report.document import build_report
from raychat.storage import Storage
assert not [m for m, module in sys.modules.items()  # (google.protobuf comes with Ray)
            if m.split(".")[0] in ("matplotlib", "huggingface_hub") or m.startswith("google.cloud")
            if module is not None]
said = []
assert prepare_default_corpus(sys.argv[1], log=said.append) == "sample"
print(said[0])
try:
    build_report(Storage(sys.argv[1]))
except RaychatError as e:
    print(e)
try:
    Storage("gs://bucket/runs?anonymous=true").check_writable("--storage-path", lease=True)
except RaychatError as e:
    print(e)
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAYCHAT_OFFLINE"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "corpus")], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    corpus_line, report_line, gcs_line = done.stdout.strip().splitlines()[-3:]
    assert "huggingface_hub is not installed (pip install 'raychat[hub]'" in corpus_line, corpus_line
    assert report_line == ("a run's report needs matplotlib, which is not installed: "
                           "pip install 'raychat[report]'"), report_line
    assert gcs_line == ("gs://bucket/runs?anonymous=true needs google.cloud.storage, which is not installed: "
                        "pip install 'raychat[gcs]'"), gcs_line
