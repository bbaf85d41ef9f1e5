"""A bad machine file on the command line: one line naming the file and the key, exit code 2
(bad input) from ``plan --calibration``, ``run --machine`` and ``$MPIATTN_MACHINE`` alike, on
every rank, before any work (``mpiattn.strategies.machines``, ``mpiattn.cli.dispatch``)."""

import copy
import json
import os
import subprocess
import sys

import pytest

from mpiattn import cli
from mpiattn.strategies import machines
from helpers import finish_group, job_env, mpiexec

GOOD = machines.PROFILES["cpu-node"].to_dict()


def _edited(edit):
    d = copy.deepcopy(GOOD)
    edit(d)
    return json.dumps(d)


#: defect -> (the file's text, what the error line must say)
DEFECTS = {
    "missing key": (_edited(lambda d: d.pop("between")), "key 'between' is missing"),
    "null value": (_edited(lambda d: d.update(rates=None)), "key 'rates' is null"),
    "wrong type": (_edited(lambda d: d.update(memory="8 GiB")), "key 'memory' must be a number"),
    "not JSON": ("{\"name\": ", "cannot read it as JSON"),
    "not an object": ("[]", "must be a JSON object"),
    "engine speeds": (_edited(lambda d: d.update(engines={"torch": {"float32": [1e9]}})),
                      "key 'engines.torch.float32' must be [forward FLOP/s, backward FLOP/s]"),
}


def _file(comm, shared_dir, text):
    path = os.path.join(shared_dir, "machine.json")
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write(text)
    comm.barrier()
    return path


def _one_line(comm, err, path, says):
    """Rank 0 printed one line naming the file and the defect; the others nothing."""
    if comm.rank == 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and path in lines[0] and says in lines[0], err
    else:
        assert err == ""


@pytest.mark.parametrize("defect", DEFECTS)
def test_plan_refuses_a_bad_calibration_with_exit_code_2(comm, shared_dir, capsys, defect):
    text, says = DEFECTS[defect]
    path = _file(comm, shared_dir, text)
    capsys.readouterr()
    code = cli.main(["plan", "--seq", "64", "--heads", "2", "--dim", "8", "--calibration", path])
    assert comm.allgather_obj(code) == [2] * comm.size
    _one_line(comm, capsys.readouterr().err, path, says)


@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("given", ["--machine", "$MPIATTN_MACHINE"])
def test_run_refuses_a_bad_machine_file_with_exit_code_2(comm, shared_dir, capsys, monkeypatch,
                                                         defect, given):
    text, says = DEFECTS[defect]
    assert cli.main(["make-data", f"{shared_dir}/in.h5", "--seq", "32", "--heads", "2", "--dim", "8",
                     "-q"]) == 0
    path = _file(comm, shared_dir, text)
    argv = ["run", f"{shared_dir}/in.h5", "-o", f"{shared_dir}/out.h5", "-q"]
    if given == "--machine":
        argv += ["--machine", path]
    else:
        monkeypatch.setenv(machines.MACHINE_VARIABLE, path)
    capsys.readouterr()
    code = cli.main(argv)
    assert comm.allgather_obj(code) == [2] * comm.size
    _one_line(comm, capsys.readouterr().err, path, says)
    assert not os.path.exists(f"{shared_dir}/out.h5")


def test_the_machine_file_is_checked_before_the_input_is_read(comm, shared_dir, capsys):
    path = _file(comm, shared_dir, DEFECTS["null value"][0])
    code = cli.main(["run", f"{shared_dir}/no-such-input.h5", "-o", f"{shared_dir}/out.h5",
                     "--machine", path])
    assert comm.allgather_obj(code) == [2] * comm.size
    _one_line(comm, capsys.readouterr().err, path, "key 'rates' is null")


def test_a_machine_the_strategy_never_reads_is_not_checked(comm, shared_dir, capsys):
    """As the library: a fixed strategy and engine leave the machine nothing to choose (the
    engine's auto reads its measured speeds: a fixed strategy alone still reads it)."""
    assert cli.main(["make-data", f"{shared_dir}/in.h5", "--seq", "32", "--heads", "2", "--dim", "8",
                     "-q"]) == 0
    path = _file(comm, shared_dir, DEFECTS["null value"][0])
    assert cli.main(["run", f"{shared_dir}/in.h5", "-o", f"{shared_dir}/out.h5", "-q",
                     "--strategy", "ring", "--engine", "native", "--machine", path]) == 0
    assert cli.main(["run", f"{shared_dir}/in.h5", "-o", f"{shared_dir}/out2.h5", "-q",
                     "--strategy", "ring", "--machine", path]) == 2


def test_the_program_under_mpiexec_exits_2_with_one_line(serial_only, tmp_path):
    assert cli.main(["make-data", str(tmp_path / "in.h5"), "--seq", "32", "--heads", "2", "--dim", "8",
                     "-q"]) == 0
    (tmp_path / "bad.json").write_text(DEFECTS["missing key"][0])
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "mpiattn", "run", "in.h5", "-o",
                          "out.h5", "--machine", "bad.json"], cwd=tmp_path, env=job_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    code, out, err = finish_group(p, 120, "the job hung")
    assert code == 2, (code, out, err)
    # (the launcher may add lines of its own: Open MPI's prterun)
    lines = [ln for ln in (out + err).splitlines() if ln.startswith("mpiattn")]
    assert len(lines) == 1 and "bad.json" in lines[0] and "key 'between' is missing" in lines[0], err
    assert "Traceback" not in err, err
    assert not (tmp_path / "out.h5").exists()
