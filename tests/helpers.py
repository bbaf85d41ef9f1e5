"""Helpers shared by the tests (imported as ``helpers``; no test module imports another).

``host``         any array as NumPy, for assertions
``mpiexec``      the launcher beside this Python (the venv's), else the one on PATH
``run_group``    run a command in its own process group, killed whole on timeout
``finish_group``  wait for such a process group, killed whole on timeout
``gone_within``  seconds until every pid of a list has ended (zombies count as ended), or None
``job_env``      the environment of an MPI job a test starts (ranks yield, one BLAS thread)
``sha256``       a file's digest (an earlier output must stay byte for byte)
``job_directory``  the current directory made a job's: an input, an earlier output, the script
``whole``        every dataset and the root attributes of an HDF5 file
``bad_input``    write an input file with one named defect
``visible_matrix``  the dense (B, N, M) visibility of causal, window, document and padding rules
``dense_attention``  float64 attention of global arrays restricted to a dense visibility mask
``install_fake_cupy``  the fake CuPy of ``fake_cupy.py`` in ``sys.modules``, GPU caches emptied
``count_validations``  count the calls of ``mpiattn.strategies.problem.validate`` (a call's
                 validation) wherever the package looks it up
"""

import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest


def host(a):
    """Any array as NumPy (for assertions)."""
    from mpiattn.backend import to_host
    return to_host(a)


def mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else (shutil.which("mpiexec") or "mpiexec")


def run_group(cmd, timeout, **kw):
    """Run ``cmd`` in its own process group; on timeout kill the whole group (ranks too) and fail.

    Returns ``(returncode, stdout, stderr)``.
    """
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    return finish_group(p, timeout, f"{cmd} ran over {timeout} s and was killed")


def finish_group(p, timeout, what):
    """Wait for a process started with ``start_new_session=True``; past ``timeout`` kill its
    whole group and fail with ``what`` and its output. Returns ``(returncode, stdout, stderr)``."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{what}:\n{out}\n{err}")
    return p.returncode, out, err


def _running(pid):
    """Whether ``pid`` is a live process (a zombie, which its parent has yet to reap, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def gone_within(pids, seconds):
    """Seconds until every process of ``pids`` has ended (zombies count), or None past ``seconds``."""
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not any(_running(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def job_env(**extra):
    """The environment of an MPI job a test starts: waiting MPICH ranks yield their core, one
    BLAS thread, unbuffered output, and none of the suite's own per-rank log settings."""
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    return env


def sha256(path):
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def job_directory(tmp_path, monkeypatch, capsys, script, *, seq, heads=2, dim=8, backward=True):
    """``tmp_path``, made the current directory, with ``in.h5`` (``make-data``), an earlier
    ``out.h5`` (a 1-process ``run``) and ``job.py`` holding ``script``."""
    from mpiattn import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["make-data", "in.h5", "--seq", str(seq), "--heads", str(heads), "--dim", str(dim),
                     "--with-dout", "-q"]) == 0
    assert cli.main(["run", "in.h5", "-o", "out.h5", "-q", "--threads", "1", "--engine", "native",
                     *([] if backward else ["--no-backward"])]) == 0
    capsys.readouterr()
    (tmp_path / "job.py").write_text(script)
    return tmp_path


def whole(path):
    """``({name: array}, {attribute: value})`` of an HDF5 file."""
    with h5py.File(path, "r") as f:
        return {name: f[name][...] for name in f}, dict(f.attrs)


def bad_input(kind, path):
    """Write an input file with one defect."""
    q = np.ones((1, 2, 6, 4), np.float32)
    k = np.ones((1, 1, 5, 4), np.float32)
    v = np.ones((1, 1, 5, 3), np.float32)
    extra = {}
    if kind == "not-hdf5":
        with open(path, "w") as fh:
            fh.write("q,k,v\n")
        return
    if kind == "no-k":
        k = None
    elif kind == "q-5d":
        q = np.ones((1, 1, 2, 6, 4), np.float32)
    elif kind == "k-1d":
        k = np.ones(5, np.float32)
    elif kind == "E":
        k = np.ones((1, 1, 5, 3), np.float32)
    elif kind == "M":
        v = np.ones((1, 1, 4, 3), np.float32)
    elif kind == "heads":
        q = np.ones((1, 3, 6, 4), np.float32)
        k, v = np.ones((1, 2, 5, 4), np.float32), np.ones((1, 2, 5, 3), np.float32)
    elif kind == "int":
        q = np.ones((1, 2, 6, 4), np.int32)
    elif kind == "complex":
        v = np.ones((1, 1, 5, 3), np.complex64)
    elif kind == "mask-shape":
        extra["key_padding_mask"] = np.zeros((1, 6), bool)
    elif kind == "mask-dtype":
        extra["key_padding_mask"] = np.zeros((1, 5), np.int8)
    elif kind == "dout-shape":
        extra["dout"] = np.ones((1, 2, 6, 4), np.float32)
    elif kind == "nan":
        q[0, 1, 5, 2] = np.nan
    elif kind == "inf":
        v[0, 0, 1, 0] = -np.inf
    with h5py.File(path, "w") as f:
        for name, x in {"q": q, "k": k, "v": v, **extra}.items():
            if x is not None:
                f[name] = x


def write_h5(comm, path, **arrays):
    """Rank 0 writes the datasets ``arrays`` to a new HDF5 file ``path``; every rank waits for it."""
    import h5py

    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            for name, x in arrays.items():
                f[name] = x
    comm.barrier()


def run_cli(comm, capsys, *argv):
    """``mpiattn.cli.main(argv)`` on every rank: ``(code, rank 0's stdout, rank 0's stderr)``
    (rank 0's text on every rank).

    Asserts that every rank returns the same exit code, that ranks other than 0
    print nothing, and that rank 0 prints at most one error line.
    """
    from mpiattn import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    codes = comm.allgather_obj(code)
    assert len(set(codes)) == 1, f"ranks disagree on the exit code: {codes}"
    if comm.rank != 0:
        assert out == "" and err == "", f"rank {comm.rank} printed: {out!r} {err!r}"
    else:
        assert err.count("error:") <= 1, err
    out, err = comm.bcast_obj((out, err) if comm.rank == 0 else None)
    return code, out, err


def install_fake_cupy(monkeypatch, **kw):
    """Put a fresh fake CuPy (``fake_cupy.install(monkeypatch, **kw)``) in ``sys.modules``.

    (mpiattn keeps no process-wide GPU state: a Comm keeps its bound device,
    streams and transport.) Call ``fake_cupy.shutdown()`` afterwards.
    """
    import fake_cupy

    return fake_cupy.install(monkeypatch, **kw)


def visible_matrix(B, N, M, causal=False, window=None, seg_q=None, seg_k=None, pad=None):
    """(B, N, M) bool: key j visible to query i, every rule written out on its own.

    ``causal``: False, True / "top-left" (``j <= i``) or "bottom-right"
    (``j <= i + M - N``); the window is measured from the same diagonal.
    """
    i = np.arange(N)[:, None]
    j = np.arange(M)[None, :]
    if causal == "bottom-right":  # query i stands where key i + M - N stands
        i = i + (M - N)
    vis = np.ones((B, N, M), dtype=bool)
    if causal:
        vis &= (j <= i)[None]
    if window is not None:
        left, right = window
        if left is not None:
            vis &= (j >= i - left)[None]
        if right is not None:
            vis &= (j <= i + right)[None]
    if seg_q is not None:
        vis &= seg_q[:, :, None] == seg_k[:, None, :]
    if pad is not None:
        vis &= ~pad[:, None, :]
    return vis


def dense_attention(Q, K, V, vis, scale=None, dO=None):
    """float64 ``(out, lse)`` (and with ``dO`` also ``(dq, dk, dv)``) of global arrays.

    ``vis`` is bool, broadcastable to ``(B, 1, N, M)`` (True = visible); it is
    shared by every head. Scores are materialised: for small test problems only.
    Query head ``h`` uses key/value head ``h // (H // Hkv)``.
    """
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    B, H, N, E = Q.shape
    G = H // K.shape[1]
    Kr, Vr = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
    s = 1 / np.sqrt(E) if scale is None else scale
    v4 = np.broadcast_to(vis, (B, 1, N, K.shape[2]))
    S = np.where(v4, s * Q @ Kr.swapaxes(-1, -2), -np.inf)
    seen = v4.any(-1)
    m = np.where(seen, S.max(-1, initial=-np.inf), 0.0)
    Pe = np.where(v4, np.exp(S - m[..., None]), 0.0)
    l = Pe.sum(-1)
    Pm = Pe / np.where(seen, l, 1.0)[..., None]
    out = Pm @ Vr
    lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    if dO is None:
        return out, lse
    dO = np.asarray(dO, dtype=np.float64)
    dP = dO @ Vr.swapaxes(-1, -2)
    dS = Pm * (dP - (dP * Pm).sum(-1, keepdims=True))
    fold = lambda x: x.reshape(B, K.shape[1], G, *x.shape[2:]).sum(2)  # noqa: E731
    return out, lse, s * dS @ Kr, fold(s * dS.swapaxes(-1, -2) @ Q), fold(Pm.swapaxes(-1, -2) @ dO)


class Reference(tuple):
    """``(out, lse, dq, dk, dv)`` with names (gradients None without ``dout``)."""

    out = property(lambda self: self[0])
    lse = property(lambda self: self[1])
    dq = property(lambda self: self[2])
    dk = property(lambda self: self[3])
    dv = property(lambda self: self[4])


def reference(q, k, v, dout=None, *, causal=False, window=None, scale=None,
              key_padding_mask=None, segment_ids=None, kv_segment_ids=None):
    """The tests' own float64 attention of global arrays, every rule written out here."""
    q = np.asarray(q)
    B, N, M = q.shape[0], q.shape[2], np.asarray(k).shape[2]
    seg_k = segment_ids if kv_segment_ids is None else kv_segment_ids
    vis = visible_matrix(B, N, M, causal, window,
                         None if segment_ids is None else np.asarray(segment_ids),
                         None if segment_ids is None else np.asarray(seg_k),
                         None if key_padding_mask is None else np.asarray(key_padding_mask))
    res = dense_attention(q, k, v, vis[:, None], scale, dout)
    return Reference(tuple(res) + (None,) * (5 - len(res)))


def torch_reference(Q, K, V, dO, vis, *, scale=None, softcap=None, bias=None, sinks=None,
                    score_mod=None):
    """float64 ``out, lse, dq, dk, dv, dsinks, max_logit`` by torch autograd.

    ``vis`` bool broadcastable to (B, H, N, M) (True = visible); ``bias`` float (B|1, H|1, N, M);
    ``score_mod(x, b, h, i, j)``: torch ops on the whole ``(B, H, N, M)`` raw scores and index
    tensors (b ``(B,1,1,1)``, h ``(1,H,1,1)``, i ``(1,1,N,1)``, j ``(1,1,1,M)``), its gradient
    (and that of any tensor it captures) by autograd.
    """
    import torch

    B, H, N, E = Q.shape
    G = H // K.shape[1]
    t = [torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in (Q, K, V)]
    q, k, v = t
    s = 1 / np.sqrt(E) if scale is None else scale
    x = s * q @ k.repeat_interleave(G, 1).transpose(-1, -2)
    y = softcap * torch.tanh(x / softcap) if softcap is not None else x
    if score_mod is not None:
        M = K.shape[2]
        idx = [torch.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])
               for axis, n in enumerate((B, H, N, M))]
        y = score_mod(y, *idx)
    vis = np.broadcast_to(vis, y.shape)
    if bias is not None:  # a -inf in the bias hides its pair
        vis = vis & np.isfinite(bias)
        y = y + torch.tensor(np.where(np.isfinite(bias), bias, 0.0))
    vis_t = torch.tensor(vis.copy())
    y = y.masked_fill(~vis_t, float("-inf"))
    seen = vis_t.any(-1)
    sk = None
    if sinks is not None:
        sk = torch.tensor(np.asarray(sinks, dtype=np.float64), requires_grad=True)
        col = sk.view(1, H, 1, 1).expand(B, H, N, 1)
        lse = torch.logsumexp(torch.cat([y, col], -1), -1)
        shift = lse
    else:  # a row that sees nothing: lse = -inf, no gradient through it
        shift = torch.logsumexp(torch.where(seen[..., None], y, torch.zeros_like(y)), -1)
        lse = torch.where(seen, shift, torch.full_like(shift, float("-inf")))
    P = torch.where(vis_t, torch.exp(y - shift[..., None]), torch.zeros_like(y))
    out = P @ v.repeat_interleave(G, 1)
    (out * torch.tensor(np.asarray(dO, dtype=np.float64))).sum().backward()
    xm = x.detach().masked_fill(~vis_t, float("-inf")).amax(dim=(0, 2, 3)).numpy()
    return (out.detach().numpy(), lse.detach().numpy(), q.grad.numpy(), k.grad.numpy(),
            v.grad.numpy(), None if sk is None else sk.grad.numpy(), xm)


#: Every registered strategy name (``hybrid`` picks its split by the model): the strategy lists of
#: the attention and mask tests; the contract suite adds every split (``registry.variants``).
def registered_strategies():
    from mpiattn.strategies import registry
    return list(registry.STRATEGIES)


#: Why a test leaves a head-sharded strategy out where the heads do not divide.
UNEVEN_HEADS = "uneven head splits: the contract's heads cases and the search cover them"


def uneven_heads(strategy, P, H, Hkv):
    """:data:`UNEVEN_HEADS` when ``strategy`` (a name; ``hybrid:UxR`` splits heads over ``U``,
    ulysses over ``P``) would split ``H`` query or ``Hkv`` key/value heads unevenly (key/value heads
    fewer than ``U`` that divide it are replicated evenly), else None: the modifier suites run
    the even splits, the contract's heads cases and the property search the uneven ones."""
    u = P if strategy == "ulysses" else int(strategy.split(":")[1].split("x")[0]) \
        if strategy.startswith("hybrid:") else None
    if u is None:
        return None
    if H % u or (Hkv % u and (strategy == "ulysses" or u % Hkv)):
        return UNEVEN_HEADS
    return None


def strategy_refusal(strategy, comm, H, Hkv, N=16, M=None):
    """Why the registered ``strategy`` refuses a call of ``H`` query and ``Hkv`` key/value heads
    on ``comm`` (its own ``supports``: e.g. ulysses needs a query head per rank), or None."""
    from mpiattn.comm import get_comm
    from mpiattn.strategies import AttentionSpec, Options, registry
    q, kv = (1, H, N, 8), (1, Hkv, N if M is None else M, 8)
    spec = AttentionSpec.from_shapes(q, kv, kv, np.float64, Options())
    return registry.get(strategy).supports(spec, get_comm(comm).topology)


def strategy_runs_engines(strategy):
    """Whether ``strategy`` runs an engine (materialized runs the products instead)."""
    from mpiattn.strategies import registry
    return registry.get(strategy).uses_engine


def count_validations(monkeypatch):
    """A list that grows by one at every call of :func:`mpiattn.strategies.problem.validate`
    (one call's local checks, agreement and planning), however a module of the package
    reached it: the counting wrapper replaces it in every loaded module that holds it
    (``strategies.plan`` for plans and the one-shot forward, ``strategies.api`` for the
    one-shot backward)."""
    import mpiattn.strategies.api  # noqa: F401 - loads it and strategies.plan, which look it up
    from mpiattn.strategies import problem

    real, calls = problem.validate, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name == "mpiattn" or name.startswith("mpiattn.")) and getattr(module, "validate", None) is real:
            monkeypatch.setattr(module, "validate", counting)
    return calls
