"""The commands: ``example`` (the default), ``run``, ``make-data``, ``info``, ``clean``."""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
from typing import Any

import numpy as np

from .. import __version__
from .. import gpu, io
from ..io import datagen
from ..comm import errors
from ..kernels import engines
from ..layouts import all_segments
from .common import EXAMPLE_ATTR, EXAMPLE_SPEC, Console, UsageError
from .steps import (gpu_status, host_names, prepare_output, rows_of_rank0, run_file, run_timer,
                    world_comm)



# ----------------------------------------------------------------- commands
def cmd_run(args: Any, con: Console) -> int:
    """``mpiattn run INPUT -o OUTPUT``."""
    c = world_comm()
    return run_file(c, con, args, args.input, args.output, args.force, {}, "run")


def _example_input() -> Any:
    """Context manager giving the path of the bundled example input (None when missing)."""
    from importlib import resources

    ref = resources.files("mpiattn").joinpath("data", "example.h5")
    if not ref.is_file():
        return contextlib.nullcontext(None)
    return resources.as_file(ref)


def cmd_example(args: Any, con: Console) -> int:
    """The default command: the bundled example, forward + backward, causal, checked."""
    c = world_comm()
    output = args.output
    exists = c.bcast_obj(os.path.lexists(output))  # rank 0 decides for everybody
    attrs = io.read_attributes(output, c) if exists else {}
    with errors.alike():  # exists and attrs come from rank 0: every rank decides alike
        if attrs is None or (exists and not attrs.get(EXAMPLE_ATTR)):
            raise FileExistsError(f"{os.path.abspath(output)} exists and is not an output of the "
                                  "mpiattn example; refusing to overwrite it (move it away or run "
                                  "in another directory)")
    args.check, args.causal = True, None
    with _example_input() as path:
        missing = c.bcast_obj(path is None or not os.path.isfile(path))
        if missing:
            return _example_regenerated(c, con, args, output)
        return run_file(c, con, args, str(path), output, True, {EXAMPLE_ATTR: 1}, "example")


def _example_regenerated(c: Any, con: Console, args: Any, output: str) -> int:
    """Bundled file missing (an unusual install): regenerate it (make-data), run, delete it.

    The regenerated input is made inside a locked temporary directory
    (:class:`mpiattn.io.temporaries.Temporary`) that is never published:
    removed at the end, on a signal, and by a later run should this one be
    killed.
    """
    target = os.path.join(os.path.dirname(os.path.abspath(output)), "mpiattn-example-in.h5")
    own = io.atomic.on_rank0(c, lambda: con.outputs.reserve(target), share=False)
    name = c.bcast_obj(own.dir if c.rank == 0 else None)
    tmp = own if c.rank == 0 else con.outputs.adopt(name)
    regen = os.path.join(tmp.dir, "example-in.h5")
    con.say("bundled example input missing: regenerating it with make-data (seed "
            f"{EXAMPLE_SPEC['seed']})")
    try:
        _make_data(c, con, regen, dict(EXAMPLE_SPEC), causal=True, scale=None, force=False)
        return run_file(c, con, args, regen, output, True, {EXAMPLE_ATTR: 1}, "example")
    finally:  # every rank has finished reading it once run_file returns or raises alike
        con.outputs.discard(tmp, remove=c.rank == 0)


def _per_head(c: Any, spec: Any, sinks: bool, alibi: bool) -> dict:
    """The whole per-head datasets make-data adds (rank 0 writes them): ``sinks``, standard
    normal from the seed, and ``alibi_slopes``, ``2^(-8 (h + 1) / H)`` (Press et al. 2022)."""
    H = spec.heads
    out = {}
    if sinks:
        out["sinks"] = np.random.default_rng([spec.seed, 7]).standard_normal(H)
    if alibi:
        out["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    return {name: rows_of_rank0(c, x) for name, x in out.items()}


def _make_data(c: Any, con: Console, output: str, spec_kw: dict, causal: bool,
               scale: float | None, force: bool, window: tuple | None = None,
               sinks: bool = False, alibi: bool = False) -> tuple[Any, dict]:
    spec = datagen.Spec(**spec_kw)
    timer = run_timer(c, con)
    nbytes = sum(math.prod(shape)  # Python ints: an absurd shape must not wrap round to "it fits"
                 * {"key_padding_mask": 1, "segment_ids": 8}.get(name, np.dtype(spec.dtype).itemsize)
                 for name, (shape, _) in spec.datasets().items())
    prepare_output(c, con, output, force, nbytes)  # before generating anything
    with timer.phase("generate"), c.collective_errors():
        rows = {}
        for name, (shape, axis) in spec.datasets().items():
            segs = all_segments(shape[axis], c.size, "contiguous")[c.rank]
            rows[name] = io.Rows(datagen.local_rows(spec, name, segs), shape[axis], axis)
        rows.update(_per_head(c, spec, sinks, alibi))
    attrs = {"causal": causal if causal == "bottom-right" else bool(causal), "scale": scale, "generator": "mpiattn make-data",
             "mpiattn_version": __version__, "seed": spec.seed, "padding": spec.padding,
             "docs": spec.docs or None,
             "window": None if window is None else [-1 if w is None else w for w in window],
             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with timer.phase("write"):
        io.write_rows(output, rows, c, attrs=attrs, force=force, outputs=con.outputs)
    return spec, timer.times


def cmd_make_data(args: Any, con: Console) -> int:
    """``mpiattn make-data OUTPUT ...``."""
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise UsageError(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    spec_kw = dict(batch=args.batch, heads=args.heads, kv_heads=kv_heads, seq=args.seq,
                   kv_seq=args.kv_seq or args.seq, dim=args.dim, value_dim=args.value_dim or args.dim,
                   dtype=args.dtype, with_dout=args.with_dout, padding=args.padding, seed=args.seed,
                   docs=args.docs)
    if args.docs and spec_kw["kv_seq"] != args.seq:
        raise UsageError(f"--docs needs --kv-seq equal to --seq (the keys take the query "
                         f"documents), got --seq {args.seq} --kv-seq {spec_kw['kv_seq']}")
    c = world_comm()
    spec, times = _make_data(c, con, args.output, spec_kw, args.causal, args.scale, args.force,
                             window=args.window, sinks=args.sinks, alibi=args.alibi)
    names = ", ".join([f"{n} {s}" for n, (s, _) in spec.datasets().items()]
                      + [f"{n} ({spec.heads},)" for n, on in (("sinks", args.sinks),
                                                              ("alibi_slopes", args.alibi)) if on])
    con.say(f"wrote {os.path.abspath(args.output)} on {c.size} rank(s): {names} ({spec.dtype}, "
            f"seed {spec.seed}); " + ", ".join(f"{k} {v:.3g} s" for k, v in times.items()))
    return 0


def _transport_line(c: Any, any_gpu: bool) -> str:
    """The CUDA-aware decision of :func:`mpiattn.gpu.describe_transport` (collective)."""
    log = logging.getLogger("mpiattn.gpu")
    level = log.level
    log.setLevel(logging.ERROR)  # its "staged" notice would repeat what info prints anyway
    try:
        summary = gpu.describe_transport(c)["summary"]  # collective; raises alike on every rank
    except Exception as exc:  # noqa: BLE001 - info must not crash
        return f"unknown ({type(exc).__name__}: {exc})"
    finally:
        log.setLevel(level)
    return summary if any_gpu else f"{summary} [unused here: no usable GPU]"


def cmd_info(args: Any, con: Console) -> int:
    """``mpiattn info``: what this installation and this job see."""
    import h5py
    import mpi4py
    from mpi4py import MPI

    c = world_comm()
    hosts = host_names(c)
    status = c.allgather_obj(gpu_status())
    gpus = [why for _, why in status]
    transport = _transport_line(c, any(ok for ok, _ in status))
    con.say(f"mpiattn    {__version__} (python {sys.version.split()[0]}, numpy {np.__version__})")
    con.say(f"mpi4py     {mpi4py.__version__}; MPI {'.'.join(map(str, MPI.Get_version()))}: "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}")
    con.say(f"h5py       {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel HDF5: "
            f"{'yes (mpio driver, collective writes)' if io.parallel_hdf5() else 'no (serial writes in turn)'}")
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    con.say(f"ranks      {c.size} on {len(by_host)} host(s): "
            + "; ".join(f"{h} ({_ranges(rs)})" for h, rs in by_host.items()))
    if len(set(gpus)) == 1:
        con.say(f"GPUs       every rank: {gpus[0]}")
    else:
        con.say("GPUs       " + "; ".join(f"rank {r}: {g}" for r, g in enumerate(gpus)))
    con.say(f"CUDA-aware {transport}")
    _threads_lines(c, con, hosts, getattr(args, "threads_info", None))
    ok, said = status[c.rank]  # said: "none (why)" where this rank has no usable GPU
    gpu_why = None if ok else "no usable GPU: " + (said[6:-1] if said.startswith("none (") else said)
    con.say("engines    " + "; ".join(_engine_line(c, e, gpu_why) for e in engines.ENGINES.values())
            + f"; auto: the fastest a calibrated machine measured, else {engines.AUTO[0]}")
    return 0


def _engine_line(c: Any, engine: Any, gpu_why: str | None) -> str:
    """``native: usable (CPU)``, ``fused: not usable (CuPy arrays only; rank 0: ...)``.

    Collective; may import torch. An engine is usable on a device when every
    rank can run it there: the CPU (NumPy arrays) needs only the engine's own
    check, the GPU (CuPy arrays) also a usable GPU on the rank (``gpu_why``:
    None where this rank has one, else why not).
    """
    devices = [d for d in ("numpy", "cupy") if d in engine.capabilities.dtypes]
    mine = {d: (gpu_why if d == "cupy" and gpu_why else engine.usable(d)) for d in devices}
    whys = c.allgather_obj(mine)
    where = [{"numpy": "CPU", "cupy": "GPU"}[d] for d in devices if all(w[d] is None for w in whys)]
    if where:
        return f"{engine.name}: usable ({', '.join(where)})"
    only = "" if len(devices) > 1 else f"{'CuPy' if devices == ['cupy'] else 'NumPy'} arrays only; "
    r, why = next((r, w[d]) for d in devices for r, w in enumerate(whys) if w[d] is not None)
    return f"{engine.name}: not usable ({only}rank {r}: {why})"


def _threads_lines(c: Any, con: Console, hosts: list[str], threads: Any) -> None:
    """``threads`` line(s) of ``info``: BLAS threads per rank and their reason, per host."""
    lines = c.allgather_obj(None if threads is None else threads.describe())
    by_text: dict[str, list[int]] = {}
    for r, text in enumerate(lines):
        by_text.setdefault(text or "not set by mpiattn", []).append(r)
    if len(by_text) == 1:
        con.say(f"threads    BLAS {next(iter(by_text))}")
        return
    for text, ranks in by_text.items():
        con.say(f"threads    {_ranges(ranks)} ({', '.join(sorted({hosts[r] for r in ranks}))}): "
                f"BLAS {text}")


def cmd_clean(args: Any, con: Console) -> int:
    """``mpiattn clean [DIR]``: remove the temporaries of dead writers (never a live one's)."""
    c = world_comm()
    directory = os.path.abspath(args.directory)
    stale = io.atomic.on_rank0(c, lambda: io.remove_stale(directory))
    for path, size in stale.removed:
        con.say(f"removed {path} ({size / 2**20:.1f} MiB), left by an mpiattn writer that died")
    for path, why in stale.kept:
        con.say(f"kept    {path}: {why}")
    if not stale.removed and not stale.kept:
        con.say(f"no mpiattn temporary files in {directory}")
    return 0


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)
