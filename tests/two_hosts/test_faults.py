"""Faults between two real hosts: every rank on both gone, one message, nothing published or left.

Runs only where ``jobs/two_hosts.sh`` has made the cluster and ``MPIATTN_TWO_HOSTS=1`` (the
two_hosts lane), in the serial session: each test launches ``python -m mpiattn run`` (through a
small script that holds one phase at a known point) on 2 hosts x 2 ranks with
``jobs/two_hosts.sh mpiexec``, makes the fault from outside, and checks:

* every rank on both hosts ends within 30 s of the fault (``ALL_GONE_S``), and no MPI daemon of
  the job outlives it;
* one message: mpiattn's single ``mpiattn:`` line (the link cut: the watchdog's, from host 1;
  SIGTERM: the signal's), or, for ranks killed by SIGKILL, which no program can report, MPICH's
  own "BAD TERMINATION" notice and no ``mpiattn:`` line;
* no output published (the earlier output byte for byte), no mpiattn temporary in the job's
  directory (shared by both hosts) and nothing in either host's own ``/dev/shm``.

The cases, and what ends the job:

``sigkill-host2``  SIGKILL to host 2's ranks while they hold inside a ring step: MPI's own
                   (Hydra sees its ranks die and kills the others).
``cut-link``       the link taken down (both ends) during a ring step: the watchdog
                   (``--watchdog 10``); without it nothing ends.
``sigterm-write``  SIGTERM to the launcher while a rank on host 2 writes its rows: mpiattn's
                   signal handling (Hydra forwards the signal to every rank on both hosts).

``MPIATTN_FAULT_TRIES=N`` repeats each case N times (default 1). No timing is asserted beyond
the 30 s within which the ranks must be gone.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import finish_group, gone_within, job_directory, job_env, sha256

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "jobs", "two_hosts.sh")
STATE = "/run/mpiattn-hosts"
LIMIT_S = 120
ALL_GONE_S = 30.0
TRIES = int(os.environ.get("MPIATTN_FAULT_TRIES", "1"))
#: This Python's directory first: the launcher runs the venv's mpiexec on host 1.
PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

JOB = textwrap.dedent("""
    import os, socket, sys, time
    from mpi4py import MPI
    from mpiattn import cli
    from mpiattn.io import writing
    from mpiattn.strategies import ring

    rank, host = MPI.COMM_WORLD.Get_rank(), socket.gethostname()
    phase, hold_host = sys.argv[1], sys.argv[2]
    with open(f"pid.{rank}", "w") as f:
        f.write(f"{os.getpid()} {host}")

    def mark(name):
        with open(f"{name}.{rank}", "w") as f:
            f.write(host)

    def wait_for_go():
        while not os.path.exists("go"):
            time.sleep(0.02)

    if phase == "ring":  # host 2's ranks hold inside a ring step, after their first block came
        real = ring.circulate
        def circulate(c, *a, **kw):
            for i, piece in enumerate(real(c, *a, **kw)):
                if i == 1:
                    mark("at-ring")
                    if host == hold_host:
                        wait_for_go()
                yield piece
        ring.circulate = circulate
    elif phase == "write":  # a rank of host 2 stalls in its write; the others wait in MPI
        real_write = writing._write_slabs
        def write_slabs(*a, **kw):
            real_write(*a, **kw)
            if host == hold_host and rank == MPI.COMM_WORLD.Get_size() // 2:
                mark("at-write")
                time.sleep(300)
        writing._write_slabs = write_slabs
    sys.argv = ["mpiattn", "run", "in.h5", "-o", "out.h5", "--force", "-q", "--engine", "native",
                "--strategy", "ring", "--watchdog", "10"]
    sys.exit(cli.main())
""")


def _cluster(*args, **kw):
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True, timeout=LIMIT_S, **kw)


def _hosts():
    return _cluster("hosts").stdout.split()


@pytest.fixture
def cluster(serial_only):
    if os.environ.get("MPIATTN_TWO_HOSTS") != "1":
        pytest.skip("needs the two-host cluster (jobs/two_hosts.sh up; MPIATTN_TWO_HOSTS=1: the two_hosts lane)")
    if _cluster("status").returncode != 0:
        pytest.skip("the two-host cluster is not up (jobs/two_hosts.sh up)")
    return _hosts()


@pytest.fixture
def job_dir(cluster, tmp_path, monkeypatch, capsys):
    """in.h5, an earlier out.h5 and the job script, in a directory both hosts see."""
    return job_directory(tmp_path, monkeypatch, capsys, JOB, seq=2048, dim=16, backward=False)


def _start(d, phase, hold_host):
    return subprocess.Popen(["bash", CLUSTER, "mpiexec", "-per-host", "2", "-n", "4", sys.executable,
                             "job.py", phase, hold_host], cwd=d, env=job_env(PATH=PATH),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(p, d, names, temporary=False):
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"the job ended before the fault (rc {p.returncode}):\n{out}\n{err}")
        if all((d / n).exists() for n in names) and (not temporary or _temporaries(d)):
            return
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    pytest.fail(f"markers {names} never appeared")


def _ranks(d):
    """``{rank: (pid, host)}`` from the job's pid files."""
    out = {}
    for r in range(4):
        pid, host = (d / f"pid.{r}").read_text().split()
        out[r] = (int(pid), host)
    return out


def _temporaries(d):
    return sorted(n for n in os.listdir(d) if ".mpiattn-" in n)


def _daemons(host1):
    """Hydra daemons of a job on this cluster (their control port is on host 1)."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if "hydra_pmi_proxy" in ln and f"--control-port {host1}:" in ln]


def _host_files(hosts):
    return {h: sorted(os.listdir(os.path.join(STATE, h, "shm"))) for h in hosts}


def _clean_after(d, hosts, before):
    """Nothing published, nothing left on either host, no daemon left (after the link is up)."""
    deadline = time.monotonic() + ALL_GONE_S
    while _daemons(hosts[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _daemons(hosts[0]) == [], "an MPI daemon outlived the job"
    assert _temporaries(d) == []
    assert _host_files(hosts) == {h: [] for h in hosts}, "a host's /dev/shm keeps files"
    assert sha256(d / "out.h5") == before, "an output was published"


def _in_a_ring_step(d, hosts):
    """The job started, every rank past its first ring block (host 2's holding there): (p, ranks)."""
    p = _start(d, "ring", hosts[1])
    _wait_for(p, d, [f"at-ring.{r}" for r in range(4)])
    ranks = _ranks(d)
    assert {h for _, h in ranks.values()} == set(hosts)
    return p, ranks


def _report(case, took, code, out, err):
    """One line for the lane's log (pytest -s): what ended the job and how fast."""
    said = _mpiattn_lines(out, err) or [ln for ln in (out + err).splitlines() if "BAD TERMINATION" in ln]
    print(f"\nfault {case}: every rank gone {took:.1f} s after it, exit code {code}; "
          f"{said[0].strip() if said else 'no message'}", flush=True)


def _mpiattn_lines(out, err):
    return [ln for ln in (out + err).splitlines() if ln.startswith("mpiattn:")]


@pytest.mark.parametrize("attempt", range(TRIES))
def test_sigkill_of_one_hosts_ranks_during_a_ring_step(job_dir, cluster, attempt):
    before = sha256(job_dir / "out.h5")
    p, ranks = _in_a_ring_step(job_dir, cluster)
    for pid, host in ranks.values():
        if host == cluster[1]:
            os.kill(pid, signal.SIGKILL)
    took = gone_within([pid for pid, _ in ranks.values()], ALL_GONE_S)
    code, out, err = finish_group(p, LIMIT_S, "the launcher did not end after the ranks were killed")
    assert took is not None, f"a rank outlived the fault by {ALL_GONE_S} s:\n{out}\n{err}"
    _report("sigkill-host2", took, code, out, err)
    assert code != 0
    assert _mpiattn_lines(out, err) == [], out + err
    assert (out + err).count("BAD TERMINATION") == 1, out + err
    _clean_after(job_dir, cluster, before)


@pytest.mark.parametrize("attempt", range(TRIES))
def test_a_cut_link_during_a_ring_step_ends_every_rank(job_dir, cluster, attempt):
    before = sha256(job_dir / "out.h5")
    p, ranks = _in_a_ring_step(job_dir, cluster)
    try:
        assert _cluster("cut").returncode == 0
        (job_dir / "go").write_text("")  # host 2's ranks go on into a ring step that cannot end
        took = gone_within([pid for pid, _ in ranks.values()], ALL_GONE_S)
    finally:
        assert _cluster("mend").returncode == 0
    code, out, err = finish_group(p, LIMIT_S, "the launcher did not end after the link was cut")
    assert took is not None, f"a rank outlived the cut by {ALL_GONE_S} s:\n{out}\n{err}"
    _report("cut-link", took, code, out, err)
    assert code == 1, (code, out, err)
    lines = _mpiattn_lines(out, err)
    assert len(lines) == 1 and "has heard nothing from rank" in lines[0], out + err
    _clean_after(job_dir, cluster, before)


@pytest.mark.parametrize("attempt", range(TRIES))
def test_sigterm_to_the_launcher_during_a_write_on_host2(job_dir, cluster, attempt):
    before = sha256(job_dir / "out.h5")
    p = _start(job_dir, "write", cluster[1])
    _wait_for(p, job_dir, ["at-write.2"], temporary=True)
    ranks = _ranks(job_dir)
    os.kill(p.pid, signal.SIGTERM)  # the launcher: two_hosts.sh execs its way into mpiexec
    took = gone_within([pid for pid, _ in ranks.values()], ALL_GONE_S)
    code, out, err = finish_group(p, LIMIT_S, "the launcher did not end after SIGTERM")
    assert took is not None, f"a rank outlived SIGTERM by {ALL_GONE_S} s:\n{out}\n{err}"
    _report("sigterm-write", took, code, out, err)
    assert code == 128 + signal.SIGTERM, (code, out, err)
    lines = _mpiattn_lines(out, err)
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "while writing" in lines[0], out + err
    _clean_after(job_dir, cluster, before)
