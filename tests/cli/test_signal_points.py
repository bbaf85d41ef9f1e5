"""A signal at every step of ``run``, ``make-data``, ``prefill`` and ``decode --append``.

Each case launches the real program (``python -m mpiattn`` through a small
script, under ``mpiexec`` or alone) with one function wrapped so that, on
the chosen rank, it sends the signal (to itself, or to every rank) right
before or after that step, and then goes on at once: the main thread keeps
running while the handler's thread reacts, which is the race being tested.
No timing is involved (the one wait: a signal meant to come before a rank's
vote is handled before the vote). Before the commit point (every rank voted to
publish) the signal must end every rank with ``128 + N``, one message,
nothing left behind and the earlier output byte-identical; from the commit
point on it is too late to matter: exit 0, the new output, one line saying
so. ``decode --append`` publishes its output and the grown cache at one
commit point: both files change, or neither.

The interleavings (issue 31): the signal reaches every rank, and one rank's
handler is held back, less or more than the time another rank waits for
rank 0's answer (``DEFER_S``, made 1.5 s here): whichever rank speaks, exactly
one message appears, and it tells what became of the files. Serial session
only (the tests start their own MPI jobs).
"""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from mpiattn import cli
from helpers import finish_group, mpiexec

LIMIT_S = 120
JOB = textwrap.dedent("""
    import importlib, os, signal, sys, time
    from mpi4py import MPI

    command, where, when, who, whom, sig, delay = sys.argv[1:8]
    who, sig = int(who), int(sig)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if delay != "-":  # "rank:seconds": that rank's handler starts late
        from mpiattn.cli import signals
        signals.DEFER_S = 1.5
        late_rank, seconds = (float(x) for x in delay.split(":"))
        handle = signals.Guard.on_signal
        def held_back(self, signum):
            if rank == late_rank:
                time.sleep(seconds)
            handle(self, signum)
        signals.Guard.on_signal = held_back
    with open(f"pid.{rank}", "w") as f:
        f.write(str(os.getpid()))

    def fire():
        if whom == "all":  # what a launcher that forwards the signal does
            for r in range(size):
                if r != rank:
                    os.kill(int(open(f"pid.{r}").read()), sig)
        os.kill(os.getpid(), sig)  # then go on at once, racing the handler's thread

    module, _, attr = where.rpartition(".")
    owner = importlib.import_module(module.split(":")[0])
    if ":" in module:
        owner = getattr(owner, module.split(":")[1])
    real, fired = getattr(owner, attr), []

    def wrapped(*a, **kw):
        mine = rank == who and not fired
        if mine and when == "before":
            fired.append(1)
            fire()
            if where.endswith("vote"):  # the signal is handled before this rank's vote
                while a[0].stopped is None:
                    time.sleep(0.001)
        result = real(*a, **kw)
        if mine and when == "after":
            fired.append(1)
            fire()
            if where.endswith("vote"):  # handled before the votes are counted: not yet committed
                while a[0].stopped is None:
                    time.sleep(0.001)
        return result
    setattr(owner, attr, wrapped)

    args = {"run": ["run", "in.h5", "-o", "out.h5", "--force", "-q", "--engine", "native"],
            "make-data": ["make-data", "out.h5", "--seq", "700", "--heads", "2", "--dim", "8",
                          "--with-dout", "--seed", "9", "--force", "-q"],
            "prefill": ["prefill", "in.h5", "-o", "out.h5", "--force", "-q"],
            "decode": ["decode", "cache.h5", "--queries", "new.h5", "-o", "out.h5", "--append",
                       "--force", "-q"]}[command]
    from mpiattn import cli
    sys.argv = ["mpiattn", *args]
    sys.exit(cli.main())
""")

# where: "module.attr" or "module:Class.attr"; who: the rank that fires (-1: the last)
R = "mpiattn.io.publishing:Outputs."
CASES = [  # (command, ranks, where, when, who, whom, signal, too late)
    ("run", 2, "mpiattn.io.remove_stale", "after", 0, "all", signal.SIGTERM, False),
    ("run", 2, "mpiattn.io.reading._read_segments", "before", -1, "self", signal.SIGINT, False),
    ("run", 2, R + "reserve", "after", 0, "self", signal.SIGTERM, False),
    ("run", 2, R + "adopt", "after", -1, "all", signal.SIGINT, False),
    ("run", 2, "mpiattn.io.writing._create", "before", 0, "self", signal.SIGTERM, False),
    ("run", 2, "mpiattn.io.writing._write_slabs", "after", -1, "self", signal.SIGTERM, False),
    ("run", 2, R + "vote", "before", -1, "self", signal.SIGINT, False),
    ("run", 2, R + "vote", "before", 0, "all", signal.SIGTERM, False),
    ("run", 2, R + "publish", "before", 0, "all", signal.SIGTERM, True),
    ("run", 2, R + "publish", "after", 0, "self", signal.SIGINT, True),
    ("run", 2, "mpiattn.cli.commands.run_file", "after", 0, "self", signal.SIGTERM, True),
    ("run", 2, "mpiattn.cli.signals:Guard.finish", "after", 0, "all", signal.SIGTERM, "finished"),
    ("run", 0, R + "reserve", "after", 0, "self", signal.SIGTERM, False),
    ("run", 0, R + "publish", "before", 0, "self", signal.SIGTERM, True),
    ("make-data", 2, R + "reserve", "after", 0, "all", signal.SIGTERM, False),
    ("make-data", 2, "mpiattn.io.writing._write_slabs", "after", 0, "self", signal.SIGINT, False),
    ("make-data", 2, R + "vote", "before", 0, "self", signal.SIGTERM, False),
    ("make-data", 2, R + "publish", "before", 0, "all", signal.SIGINT, True),
    ("prefill", 2, "mpiattn.io.reading._read_segments", "before", -1, "all", signal.SIGTERM, False),
    ("prefill", 2, R + "adopt", "after", -1, "self", signal.SIGINT, False),
    ("prefill", 2, "mpiattn.io.writing._write_slabs", "after", 0, "self", signal.SIGTERM, False),
    ("prefill", 2, R + "vote", "before", -1, "all", signal.SIGTERM, False),
    ("prefill", 2, R + "publish", "before", 0, "self", signal.SIGINT, True),
    ("prefill", 0, R + "vote", "after", 0, "self", signal.SIGTERM, False),
    ("decode", 2, "mpiattn.io.kvstore.read_cache_rows", "after", -1, "all", signal.SIGINT, False),
    ("decode", 2, "mpiattn.inference:KVCache.attend", "before", 0, "self", signal.SIGTERM, False),
    ("decode", 2, R + "reserve", "after", 0, "all", signal.SIGTERM, False),
    ("decode", 2, R + "adopt", "after", -1, "all", signal.SIGINT, False),
    ("decode", 2, "mpiattn.io.writing._write_slabs", "after", -1, "self", signal.SIGTERM, False),
    ("decode", 2, R + "vote", "before", 0, "all", signal.SIGINT, False),
    ("decode", 2, R + "vote", "after", 0, "self", signal.SIGTERM, False),
    ("decode", 2, R + "vote", "after", -1, "all", signal.SIGTERM, False),
    ("decode", 2, R + "decided", "after", 0, "all", signal.SIGINT, True),
    ("decode", 2, R + "publish", "before", 0, "all", signal.SIGTERM, True),
    ("decode", 2, R + "settle", "after", -1, "self", signal.SIGINT, True),
    ("decode", 2, R + "settle", "after", 0, "all", signal.SIGTERM, True),
    ("decode", 0, R + "vote", "after", 0, "self", signal.SIGINT, False),
    ("decode", 0, R + "publish", "before", 0, "self", signal.SIGTERM, True),
]


def _env():
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    return env


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """in.h5, an earlier out.h5 (forward only), a cache (cache.h5, mode 640) and the new token
    of a decode step (new.h5), made once for the module (each test works on copies)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:  # (a module fixture comes before serial_only's skip)
        pytest.skip("launches mpiexec itself; runs in the single-process session")
    where = tmp_path_factory.mktemp("signal-point-files")
    run = lambda *argv: cli.main([*argv[:1], *(str(where / a) if a.endswith(".h5") else a  # noqa: E731
                                               for a in argv[1:])])
    assert run("make-data", "in.h5", "--seq", "600", "--heads", "2", "--dim", "8", "--with-dout",
               "-q") == 0
    assert run("run", "in.h5", "-o", "out.h5", "-q", "--threads", "1", "--engine", "native",
               "--no-backward") == 0
    assert run("prefill", "in.h5", "-o", "cache.h5", "-q", "--page", "64") == 0
    os.chmod(where / "cache.h5", 0o640)
    assert run("make-data", "new.h5", "--seq", "1", "--heads", "2", "--dim", "8", "--seed", "3",
               "-q") == 0
    return where


@pytest.fixture
def job_dir(serial_only, files, tmp_path, monkeypatch, capsys):
    """A copy of the module's files (modes and times kept) and the job script."""
    monkeypatch.chdir(tmp_path)
    for name in ("in.h5", "out.h5", "cache.h5", "new.h5"):
        shutil.copy2(files / name, tmp_path / name)
    capsys.readouterr()
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def _launch(job_dir, command, ranks, where, when, who, whom, sig, delay="-"):
    cmd = [sys.executable, "job.py", command, where, when,
           str(who if who >= 0 else max(ranks, 1) - 1), whom, str(int(sig)), delay]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    p = subprocess.Popen(cmd, cwd=job_dir, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    return finish_group(p, LIMIT_S, "the job did not end after the signal")


def _check_outcome(job_dir, command, sig, late, before, code, out, err):
    """One message, nothing left behind, and the files as the message says."""
    said = [ln for ln in (out + err).splitlines() if ln.startswith("mpiattn:")]
    left = sorted(n for n in os.listdir(job_dir) if ".mpiattn-" in n)
    assert left == [], (left, out, err)
    assert len(said) == 1 and sig.name in said[0], (code, out, err)
    now = {name: _digest(job_dir / name) for name in before}
    grows = command == "decode"
    if late:  # the commit point had passed: the new output is published, and the run says so
        assert code == 0, (code, out, err)
        assert ("too late to matter" if late is True else "after the run had finished") in said[0]
        assert now["out.h5"] != before["out.h5"]
        assert command != "run" or "dq" in cli_datasets(job_dir / "out.h5")
        assert (now["cache.h5"] != before["cache.h5"]) == grows  # both files, or neither
        if grows:
            assert cache_length(job_dir / "cache.h5") == 601
            assert oct(os.stat(job_dir / "cache.h5").st_mode & 0o777) == oct(0o640)
    else:
        assert code == 128 + sig, (code, out, err)
        assert "existing outputs untouched" in said[0], said
        assert now == before
        for name in re.findall(r"removed ([^;]*);", said[0])[:1]:
            for tmp in name.split(", "):
                assert ".mpiattn-" in tmp and not (job_dir / tmp).exists()


@pytest.mark.parametrize("command,ranks,where,when,who,whom,sig,late", CASES,
                         ids=[f"{c[0]}-{c[1]}ranks-{c[2].rpartition('.')[2]}-{c[3]}-r{c[4]}-"
                              f"{c[5]}-{c[6].name}" for c in CASES])
def test_a_signal_at_each_step(job_dir, command, ranks, where, when, who, whom, sig, late):
    before = {name: _digest(job_dir / name) for name in ("out.h5", "cache.h5")}
    code, out, err = _launch(job_dir, command, ranks, where, when, who, whom, sig)
    _check_outcome(job_dir, command, sig, late, before, code, out, err)


# (command, where, when, who fires, the rank whose handler is held back, seconds, signal, too
# late): DEFER_S is 1.5 s in the job: 0.5 s lets rank 0 answer late but in time, 2.5 s makes the
# other rank give up waiting and speak alone (1 s from DEFER_S either way: the abort of a rank that
# spoke alone must end rank 0 before its held handler runs; 0.5 s was seen to be too little).
# Adopt runs on rank 1 only, publish on rank 0 only.
# Each step with both signals with rank 0 held past DEFER_S, and one signal each for the shorter
# holds; decode --append (two files at one commit point) with rank 0 held only.
_HOLDS = {"run": ((0, 2.5, signal.SIGINT), (0, 2.5, signal.SIGTERM), (1, 0.5, signal.SIGTERM),
                  (0, 0.5, signal.SIGINT)),
          "decode": ((0, 2.5, signal.SIGINT), (0, 0.5, signal.SIGTERM))}
HELD = [(cmd, where, when, who, held, seconds, sig, late)
        for cmd in ("run", "decode")
        for where, when, who, late in ((R + "adopt", "after", 1, False),
                                       (R + "vote", "after", 0, False),
                                       (R + "vote", "before", 1, False),
                                       (R + "publish", "before", 0, True))
        for held, seconds, sig in _HOLDS[cmd]]


@pytest.mark.parametrize("command,where,when,who,held,seconds,sig,late", HELD,
                         ids=[f"{c[0]}-{c[1].rpartition('.')[2]}-{c[2]}-r{c[3]}-rank{c[4]}-held-"
                              f"{c[5]:g}s-{c[6].name}" for c in HELD])
def test_one_message_whichever_handler_runs_first(job_dir, command, where, when, who, held,
                                                  seconds, sig, late):
    """Issue 31: a signal to every rank at once, one rank's handler held back."""
    before = {name: _digest(job_dir / name) for name in ("out.h5", "cache.h5")}
    code, out, err = _launch(job_dir, command, 2, where, when, who, "all", sig, f"{held}:{seconds}")
    _check_outcome(job_dir, command, sig, late, before, code, out, err)


# (command, ranks, where, who fires and is held back 1 s): the signal reaches the process before
# it votes, but its handler runs late; the rank handles it before it votes all the same.
SLOW = [("run", 0, R + "reserve", 0), ("decode", 0, R + "reserve", 0),
        ("run", 2, R + "reserve", 0), ("run", 2, "mpiattn.io.writing._write_slabs", 1),
        ("decode", 2, "mpiattn.io.writing._write_slabs", 0)]


@pytest.mark.parametrize("command,ranks,where,who", SLOW,
                         ids=[f"{c[0]}-{c[1]}ranks-{c[2].rpartition('.')[2]}-r{c[3]}" for c in SLOW])
def test_a_signal_received_before_the_vote_is_never_late(job_dir, command, ranks, where, who):
    """A handler held back past the end of the run: the signal still stops it (not "too late")."""
    before = {name: _digest(job_dir / name) for name in ("out.h5", "cache.h5")}
    code, out, err = _launch(job_dir, command, ranks, where, "after", who, "self", signal.SIGTERM,
                             f"{who}:1.5")
    _check_outcome(job_dir, command, signal.SIGTERM, False, before, code, out, err)


def cache_length(path):
    import h5py
    with h5py.File(path, "r") as f:
        return int(f.attrs["length"])


def cli_datasets(path):
    import h5py
    with h5py.File(path, "r") as f:
        return sorted(f)
