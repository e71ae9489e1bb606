# Sourced by .ci/install and .ci/run: the virtual environment attnx is installed into.
# The active one ($VIRTUAL_ENV) when there is one, else ./.venv (created by .ci/install), so
# that the commands work on a Python that refuses installs into the system (PEP 668).
# ./.venv/bin/attnx is always the installed command: with another environment active, .venv
# is made a link to it (unless a real .venv is there already).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${VIRTUAL_ENV:-}" ]; then
    ATTNX_VENV=$VIRTUAL_ENV
    if [ ! -e "$ROOT/.venv" ] || [ -L "$ROOT/.venv" ]; then
        [ "$(cd "$ATTNX_VENV" && pwd -P)" = "$ROOT/.venv" ] || ln -sfn "$ATTNX_VENV" "$ROOT/.venv"
    fi
else
    ATTNX_VENV=$ROOT/.venv
fi
ATTNX_PY=$ATTNX_VENV/bin/python
