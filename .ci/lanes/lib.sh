# shellcheck shell=bash
# Helpers shared by the CI lanes (sourced by .ci/lanes/<name>.sh, not run on its own).
#
# A lane calls `lane_init NAME`, then `verdict PASS`, `verdict FAIL "why"` or
# `verdict SKIP "why"` (which exit). Whatever ends the lane (a verdict, an error, a
# signal), the EXIT trap first runs the lane's `lane_cleanup` function if it defined one,
# then prints exactly one final line: "LANE NAME: PASS", "LANE NAME: FAIL (why)" or
# "LANE NAME: SKIP (why)". Exit status: 0 for PASS and SKIP, 1 for FAIL.
#
# SKIP is only for a machine that cannot install the lane's stack (apt-get or a package
# download fails); anything that goes wrong after the stack is installed is a FAIL.

LANE_NAME=""
LANE_VERDICT=""
APT_WHY=""      # set by apt_install, read by the lanes
export APT_WHY

lane_init() {
    LANE_NAME=$1
    LANE_T0=$SECONDS
    LANE_TMP=$(mktemp -d "/tmp/mpiattn-lane-$1.XXXXXX")
    trap lane_finish EXIT
    trap 'LANE_VERDICT=${LANE_VERDICT:-"FAIL (stopped by SIGTERM)"}; exit 143' TERM
    trap 'LANE_VERDICT=${LANE_VERDICT:-"FAIL (stopped by SIGINT)"}; exit 130' INT
    # No virtual environment of the caller (e.g. the main .venv with pip's mpich, whose
    # bin/ has its own mpiexec and mpicc) may leak into a lane.
    if [[ -n ${VIRTUAL_ENV:-} ]]; then
        PATH=$(tr ':' '\n' <<<"$PATH" | grep -vxF "$VIRTUAL_ENV/bin" | paste -sd: -)
        unset VIRTUAL_ENV
    fi
    unset PYTHONHOME MPI4PY_LIBMPI
    export PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
    export DEBIAN_FRONTEND=noninteractive
    # pytest's tmp_path root of its own: pytest sessions running at the same time on this machine
    # (other checkouts, other lanes) share /tmp/pytest-of-$USER and race on its cleanup
    mkdir -p "$LANE_TMP/pytest"
    export PYTEST_DEBUG_TEMPROOT=$LANE_TMP/pytest
    echo "=== lane $LANE_NAME: start $(date -u +%H:%M:%SZ)"
}

verdict() {  # verdict PASS | verdict FAIL "why" | verdict SKIP "why"
    LANE_VERDICT=$1${2:+" ($2)"}
    exit 0
}

step() {  # step "what": a visible marker in the lane's log, with the time since the start
    echo "=== lane $LANE_NAME [$((SECONDS - LANE_T0)) s]: $*"
}

lane_finish() {
    local rc=$?
    trap - EXIT TERM INT
    if declare -F lane_cleanup >/dev/null; then
        lane_cleanup || echo "lane $LANE_NAME: cleanup failed (exit $?)"
    fi
    rm -rf "$LANE_TMP"
    [[ -n $LANE_VERDICT ]] || LANE_VERDICT="FAIL (stopped early, exit $rc)"
    echo "=== lane $LANE_NAME: took $((SECONDS - LANE_T0)) s"
    echo "LANE $LANE_NAME: $LANE_VERDICT"
    [[ $LANE_VERDICT != FAIL* ]]
    exit $?
}

suite_summary() {  # suite_summary LOG: the last "N passed, N failed, N skipped" line of run_all.py
    grep -aE '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -n 1
}

sum_summaries() {  # sum_summaries LOG...: one "N passed, N failed, N skipped" line, the logs' pytest
    # summaries summed (of each log its last summary, the first on that line: every rank prints one)
    python3 - "$@" <<'PYEOF'
import re, sys
total = dict.fromkeys(("passed", "failed", "skipped"), 0)
for path in sys.argv[1:]:
    try:
        lines = [ln for ln in open(path, errors="replace") if re.search(r"\d+ (passed|failed)", ln)]
    except OSError:
        lines = []
    # the first summary on the last line (ranks' lines may run together on one line)
    first = re.search(r"((?:\d+ \w+,? )+)in [\d.]+s", lines[-1]) if lines else None
    for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?)", first.group(1) if first else ""):
        total["failed" if w.startswith("error") else w] += int(n)
print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
PYEOF
}

installed() {  # installed PKG...: true when every Debian package is installed
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}

apt_install() {  # apt_install PKG...: install Debian packages; on failure APT_WHY says why
    APT_WHY=""
    if installed "$@"; then
        echo "already installed: $*"
        return 0
    fi
    if [[ $(id -u) != 0 ]]; then
        APT_WHY="not root: cannot apt-get install $*"
        return 1
    fi
    # apt-get update once per CI run: .ci/run points MPIATTN_CI_APT_STAMP at a file that
    # records the first lane's outcome; a lane run by hand updates for itself.
    local stamp=${MPIATTN_CI_APT_STAMP:-}
    if [[ -z $stamp || ! -s $stamp ]]; then
        local log
        if log=$(timeout 300 apt-get update -q 2>&1); then
            [[ -n $stamp ]] && echo ok >"$stamp"
        else
            [[ -n $stamp ]] && echo "apt-get update failed: $(tail -n 1 <<<"$log")" >"$stamp"
            APT_WHY="apt-get update failed: $(tail -n 1 <<<"$log")"
            return 1
        fi
    elif [[ $(cat "$stamp") != ok ]]; then
        APT_WHY=$(cat "$stamp")
        return 1
    fi
    local out
    if ! out=$(timeout 900 apt-get install -y -q "$@" 2>&1); then
        echo "$out" | tail -n 20
        APT_WHY="apt-get install $* failed: $(grep -E '^E:' <<<"$out" | head -n 1)"
        return 1
    fi
    echo "$out" | tail -n 3
}
