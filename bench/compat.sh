#!/usr/bin/env bash
# Install raychat into a fresh venv for each pyenv Python and run a tiny check (import, a plan).
# Usage: bench/compat.sh [3.10 3.12 3.13]   (default: those three). Torch's CPU wheel comes from
# download.pytorch.org (~200 MB per Python); record the outcome in bench/RESULTS.md "Compatibility".
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSIONS=("${@:-3.10 3.12 3.13}")
for minor in ${VERSIONS[@]}; do
    python=$(ls -d /root/.pyenv/versions/"$minor".*/bin/python 2>/dev/null | tail -1)
    if [ -z "$python" ]; then echo "python $minor: not in pyenv, skipped"; continue; fi
    venv=$(mktemp -d)/venv
    start=$SECONDS
    if "$python" -m venv "$venv" \
        && "$venv/bin/pip" install -q --extra-index-url https://download.pytorch.org/whl/cpu "$ROOT" \
        && "$venv/bin/python" -c "import raychat, raychat.corpus.cli, raychat.train" \
        && (cd /tmp && RAYCHAT_HOME=$(mktemp -d) "$venv/bin/python" -m raychat.plan --depth 4 >/dev/null); then
        echo "python $("$python" -V 2>&1 | cut -d' ' -f2): OK (install + import + plan, $((SECONDS - start)) s)"
    else
        echo "python $("$python" -V 2>&1 | cut -d' ' -f2): FAILED after $((SECONDS - start)) s"
    fi
    rm -rf "$(dirname "$venv")"
done
