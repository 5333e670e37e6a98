#!/usr/bin/env bash
# kvfleet's two entry points on a fresh clone:
#   ./run.sh demo   the main job (the cluster demo: local Ray, 2 replicas, a burst of streams)
#   ./run.sh test   the whole test suite (CPU; Triton kernels under TRITON_INTERPRET=1)
# Each creates .venv/ in the repository root if it is missing and installs what is needed.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

ensure_venv() {
  local stamp=".venv/.kvfleet-$(sha1sum pyproject.toml | cut -c1-12)"
  [[ -f "$stamp" ]] && return
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build of torch first, pinned, so nothing pulls the CUDA wheels.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  rm -f .venv/.kvfleet-*; touch "$stamp"
}

case "${1:-}" in
  demo) ensure_venv; shift; exec .venv/bin/python -m cluster demo "$@" ;;
  test)
    ensure_venv; shift
    pytest=(.venv/bin/python -m pytest -q -m "not gpu" --timeout=600 --durations=15)
    [[ $# -gt 0 ]] && exec "${pytest[@]}" "$@"
    # The kernel, replica and router tests are CPU work with no clock in them (Triton's
    # interpreter, ~12 of the suite's ~26 min on 2 cores): two workers run them in ~9. The
    # rest start Ray clusters, servers and timed load, so they run one at a time, after.
    status=0
    "${pytest[@]}" -n 2 tests/kernels tests/replica tests/router || status=$?
    "${pytest[@]}" --ignore=tests/kernels --ignore=tests/replica --ignore=tests/router \
      || status=$?
    exit "$status" ;;
  *) echo "usage: ./run.sh demo | test [pytest args]" >&2; exit 2 ;;
esac
