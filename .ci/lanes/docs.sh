#!/usr/bin/env bash
# CI lane "docs": the documentation site (Sphinx, numpydoc, MyST pages of docs/), built
# warning-free (-W), then every ">>>" example of the docstrings in the API reference run
# by Sphinx's doctest builder (one process). It uses the main suite's venv (.venv, made by
# the README command; created here when the lane runs alone) with the docs extra added:
# torch is already there, so the lane installs only Sphinx and its extensions.
# Last line: "LANE docs: PASS", "LANE docs: FAIL (why)" or "LANE docs: SKIP (why)".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init docs

VENV=$PWD/.venv
PY=$VENV/bin/python
if [[ ! -x $PY ]]; then
    step "venv $VENV (the README command's)"
    python3 -m venv "$VENV" || verdict FAIL "python3 -m venv failed"
fi
step "pip install -e .[mpich,docs]"
"$PY" -m pip install -q -e ".[mpich,docs]" || verdict SKIP "pip could not install the docs extra"

OUT=$LANE_TMP/site
export OMP_NUM_THREADS=1
step "sphinx-build -W -b html docs $OUT/html"
timeout 600 "$VENV/bin/sphinx-build" -W --keep-going -q -b html docs "$OUT/html" \
    || verdict FAIL "sphinx-build -b html reported warnings or errors"
[[ -f $OUT/html/index.html && -f $OUT/html/_generated/mpiattn.torch.attention.html ]] \
    || verdict FAIL "the site has no index or no API page for mpiattn.torch.attention"
step "sphinx-build -W -b doctest docs $OUT/doctest"
timeout 600 "$VENV/bin/sphinx-build" -W --keep-going -q -b doctest docs "$OUT/doctest" \
    || verdict FAIL "a docstring example failed (sphinx-build -b doctest)"
tail -n 5 "$OUT/doctest/output.txt"
verdict PASS
