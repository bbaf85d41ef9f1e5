"""Machine (calibration) files, checked whole: one :class:`MachineFileError` naming the file and
every missing, null, badly typed or unknown key, from the loader and from a library call's
``machine=`` alike on every rank (``mpiattn.strategies.machines``). The command line's exit
code: ``tests/cli/test_machine_files_cli.py``."""

import copy
import json

import numpy as np
import pytest

import mpiattn
from mpiattn.comm.errors import Agreed
from mpiattn.strategies import machines
from mpiattn.strategies.machines import MachineFileError

GOOD = machines.PROFILES["cpu-node"].to_dict()


def _with(value, *path):
    """The good document with the key at ``path`` set to ``value``."""
    d = root = copy.deepcopy(GOOD)
    *outer, last = path
    for key in outer:
        d = d[key]
    d[last] = value
    return root


def _missing(*path):
    """The good document's text without the key at ``path``."""
    root = copy.deepcopy(GOOD)
    d = root
    for key in path[:-1]:
        d = d[key]
    del d[path[-1]]
    return json.dumps(root)


#: defect -> (the file's text, what the message must say)
DEFECTS = {
    "missing key": (_missing("inside"), "key 'inside' is missing"),
    "missing rates": (_missing("rates"), "key 'rates' is missing"),
    "missing link field": (_missing("between", "bandwidth"), "key 'between.bandwidth' is missing"),
    "null rates": (json.dumps(_with(None, "rates")), "key 'rates' is null"),
    "null name": (json.dumps(_with(None, "name")), "key 'name' is null"),
    "null link": (json.dumps(_with(None, "inside")), "key 'inside' is null"),
    "null rate": (json.dumps(_with(None, "rates", "float32")), "key 'rates.float32' is null"),
    "null optional number": (json.dumps(_with(None, "memory")), "key 'memory' is null"),
    "string for a number": (json.dumps(_with("0.5", "overlap")),
                            "key 'overlap' must be a number, not the string '0.5'"),
    "boolean for a number": (json.dumps(_with(True, "backward_ratio")),
                             "key 'backward_ratio' must be a number, not the boolean true"),
    "array for a link": (json.dumps(_with([1e-6, 1e9], "inside")),
                         "key 'inside' must be an object"),
    "number for the rates": (json.dumps(_with(8e10, "rates")), "key 'rates' must be an object"),
    "number for a name": (json.dumps(_with(7, "name")), "key 'name' must be a string"),
    "string in a link": (json.dumps(_with("fast", "between", "latency_s")),
                         "key 'between.latency_s' must be a number"),
    "unknown key": (json.dumps(_with(0.5, "overlap_betwen")), "unknown key 'overlap_betwen'"),
    "out of range": (json.dumps(_with(1.5, "overlap")), "overlap must be >= 0 and <= 1"),
    "not JSON": ("{\"name\": \"x\",", "cannot read it as JSON"),
    "not text": (b"\xff\xfe{}", "cannot read it as JSON"),
    "an array": ("[1, 2]", "must be a JSON object with keys name, inside"),
    "a number": ("3", "must be a JSON object"),
    "null document": ("null", "must be a JSON object"),
    "empty object": ("{}", "key 'name' is missing; key 'inside' is missing"),
}


def _write(path, text):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_is_one_error_naming_the_file_and_the_key(tmp_path, defect):
    text, says = DEFECTS[defect]
    path = _write(tmp_path / "machine.json", text)
    with pytest.raises(MachineFileError) as got:
        machines.load(path)
    message = str(got.value)
    assert message.startswith(f"machine file {path}: ") and says in message, message
    assert "\n" not in message and "Error" not in message  # one line, no raw exception text
    assert isinstance(got.value, ValueError)  # what callers caught before


def test_every_defect_of_a_file_is_named_at_once(tmp_path):
    d = _with(None, "rates")
    d["overlap"] = "high"
    del d["between"]
    d["colour"] = "blue"
    path = _write(tmp_path / "m.json", json.dumps(d))
    with pytest.raises(MachineFileError) as got:
        machines.load(path)
    for says in ("key 'rates' is null", "key 'overlap' must be a number", "key 'between' is missing",
                 "unknown key 'colour'"):
        assert says in str(got.value)


def test_a_name_that_is_neither_a_profile_nor_a_file(tmp_path):
    with pytest.raises(MachineFileError, match="neither a profile"):
        machines.load(str(tmp_path / "absent.json"))


def test_good_files_load_and_the_optional_keys_may_be_left_out(tmp_path):
    path = _write(tmp_path / "m.json", json.dumps(GOOD))
    assert machines.load(path) == machines.PROFILES["cpu-node"]
    short = {k: GOOD[k] for k in ("name", "inside", "between", "rates")}
    short["overlap_between"] = None  # null here means "as overlap"
    m = machines.load(_write(tmp_path / "short.json", json.dumps(short)))
    assert (m.overlap, m.memory, m.between_overlap) == (1.0, 0.0, 1.0)
    ints = _with(2, "inside", "latency_s")  # JSON integers are numbers
    assert machines.load(_write(tmp_path / "ints.json", json.dumps(ints))).inside.latency_s == 2.0


def test_a_call_s_machine_file_error_is_the_same_on_every_rank(comm, shared_dir, monkeypatch):
    path = f"{shared_dir}/machine.json"
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write(json.dumps(_with(None, "rates")))
    comm.barrier()
    q = np.random.default_rng(0).standard_normal((1, 2, 8, 4)).astype(np.float32)
    errors = []
    for how in ("machine=", "$" + machines.MACHINE_VARIABLE):
        if how == "machine=":
            call = lambda: mpiattn.attention(q, q[:, :1], q[:, :1], machine=path)  # noqa: E731
        else:
            monkeypatch.setenv(machines.MACHINE_VARIABLE, path)
            call = lambda: mpiattn.attention(q, q[:, :1], q[:, :1])  # noqa: E731
        try:
            call()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - compared below, after the gathering
            errors.append((type(exc).__name__, isinstance(exc, Agreed), str(exc)))
    everywhere = comm.allgather_obj(errors)
    assert all(e == everywhere[0] for e in everywhere)
    for name, agreed, message in everywhere[0]:
        assert name == "MachineFileError" and agreed and path in message and "'rates' is null" in message
