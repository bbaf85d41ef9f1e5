"""Chunked prefill (pass-KV, pass-Q, the rule between them) and caches kept in HDF5 across jobs.

Chunked prefill must equal full causal attention over the whole sequence (float64
reference on the gathered arrays); a cache saved at P ranks and loaded at P' (a
sub-communicator of the run) must continue exactly like one that never left memory; bad
files give one clear error on every rank and nothing is half-written.
"""

import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn.comm.topology import Topology
from mpiattn.inference.decode import predict_step
from mpiattn.inference.prefill import choose
from mpiattn.inference.pricing import PassKV, PassQ, chunk_spec
from mpiattn.strategies import machines, model

from helpers import host, reference


def _seq(seed, B=1, H=4, Hkv=2, L=70, E=8, Ev=5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, L, E)), rng.standard_normal((B, Hkv, L, E)),
            rng.standard_normal((B, Hkv, L, Ev)))


@pytest.mark.parametrize("variant", ["pass-kv", "pass-q", "auto"])
@pytest.mark.parametrize("window,layout", [(None, "contiguous"), ((9, 0), "zigzag"), ((4, 3), "contiguous")])
def test_chunked_prefill_equals_full_attention(comm, xp, variant, window, layout):
    Q, K, V = _seq(11)
    ref = reference(Q, K, V, causal=True, window=window)
    n0 = 23
    cache = mpiattn.KVCache.from_shards(xp.asarray(mpiattn.shard(K[:, :, :n0])),
                                        xp.asarray(mpiattn.shard(V[:, :, :n0])), page=3)
    cache.append(xp.asarray(K[:, :, n0:n0 + 4]), xp.asarray(V[:, :, n0:n0 + 4]))
    pos = n0 + 4
    for C in (17, 1, 22):  # chunks after a prefill and appends; each kept in the cache
        sl = slice(pos, pos + C)
        used = {}
        out, lse = cache.prefill(*(xp.asarray(mpiattn.shard(x[:, :, sl], layout=layout))
                                   for x in (Q, K, V)), layout=layout, variant=variant,
                                 window=window, details=used)
        assert used["variant"] in ("pass-kv", "pass-q") and (variant == "auto" or used["variant"] == variant)
        got_o = host(mpiattn.gather(out, layout=layout, root=None))
        got_l = host(mpiattn.gather(lse, axis=-1, layout=layout, root=None))
        np.testing.assert_allclose(got_o, ref.out[:, :, sl], atol=1e-12)
        np.testing.assert_allclose(got_l, ref.lse[:, :, sl], atol=1e-12)
        pos += C
    assert cache.length == pos
    got = cache.attend(xp.asarray(Q[:, :, pos - 2:pos]), window=window)  # decode after the chunks
    np.testing.assert_allclose(host(got[0]), ref.out[:, :, pos - 2:pos], atol=1e-12)


def _chunk(C, cached, dtype="float16", window=None, B=1, H=32, Hkv=8, E=128, Ev=128,
           layout="contiguous"):
    return chunk_spec(B, H, Hkv, C, cached, E, Ev, dtype, window, layout)


def test_the_rule_picks_pass_q_for_short_chunks_and_pass_kv_for_long_ones():
    m, eight_nodes = machines.PROFILES["h200-nvlink-ndr"], Topology.blocks(8, 1)
    assert choose(_chunk(128, 1_000_000), eight_nodes, m, rate_dtype="bfloat16").variant == "pass-q"
    assert choose(_chunk(128_000, 0), eight_nodes, m, rate_dtype="bfloat16").variant == "pass-kv"
    cpu, node = machines.PROFILES["cpu-node"], Topology.blocks(2, 2)
    assert choose(_chunk(1, 100_000, "float32"), node, cpu).variant == "pass-q"
    assert choose(_chunk(100, 100, "float32"), Topology.blocks(1, 1), cpu).variant == "pass-q"
    # MQA over two nodes: pass-KV's few bytes hide behind the compute when its query rows are
    # balanced (zigzag); contiguous rows leave the second rank three quarters of the causal pairs
    two_nodes = Topology.blocks(2, 1)
    mqa = dict(dtype="float32", Hkv=1)
    assert choose(_chunk(20_000, 0, layout="zigzag", **mqa), two_nodes, cpu).variant == "pass-kv"
    contiguous = choose(_chunk(20_000, 0, **mqa), two_nodes, cpu)
    assert contiguous.variant == "pass-q"
    assert contiguous.pass_kv_s == pytest.approx(1.5 * contiguous.pass_q_s, rel=0.01)


def test_the_variants_bytes_and_compute_are_their_formulas_windows_counted():
    """pass-Q sends ceil(C / P) query rows to each other rank and gets (Ev + 1) accumulation words
    of each back; pass-KV each rank's (M + C) / P key rows round the ring. The compute: the
    visible pairs of the chunk (causal after the cache, a window's w + 1 keys a row), pass-KV's
    shared by the query rows' ranks, pass-Q's by the ranks holding the visible keys' pages."""
    m, P = machines.PROFILES["cpu-node"], 4
    topo = Topology.blocks(P, P)
    B, H, Hkv, E, Ev, C, M0 = 2, 8, 2, 16, 8, 1000, 50_000
    spec = _chunk(C, M0, "float32", None, B, H, Hkv, E, Ev)
    ch = choose(spec, topo, m)
    assert ch.pass_q_bytes == (P - 1) * 250 * B * H * (E * 4 + (Ev + 1) * 4)
    assert ch.pass_kv_bytes == pytest.approx((P - 1) * (M0 + C) / P * B * Hkv * (E + Ev) * 4)
    per_pair = 2 * B * H * (E + Ev) / m.rate("float32")
    full = C * M0 + C * (C + 1) / 2
    for w, pairs, holders in ((None, full, P), ((300, 0), C * 301, 1), ((20_000, 0), C * 20_001, 4)):
        spec = _chunk(C, M0, "float32", w, B, H, Hkv, E, Ev)
        kv, q = (model.predict(s, spec, topo, 512, m) for s in (PassKV(), PassQ(page=4096)))
        assert q.compute_s == pytest.approx(per_pair * pairs / holders)
        last = np.arange(C - C // P, C)  # contiguous rows: the last rank's see the most keys
        busiest = np.minimum(M0 + last + 1, np.inf if w is None else w[0] + 1).sum()
        assert kv.compute_s == pytest.approx(per_pair * busiest)


def test_a_decode_step_reads_the_keys_its_window_leaves(comm):
    m, P = machines.PROFILES["cpu-node"], 4
    topo = Topology.blocks(P, P)
    B, H, Hkv, E, Ev, M0 = 1, 8, 2, 64, 64, 1_000_000
    row = B * Hkv * (E + Ev) * 4 / m.memory_bandwidth
    full = predict_step(_chunk(1, M0, "float32", None, B, H, Hkv, E, Ev), topo, m)
    assert full["read_s"] == pytest.approx((M0 + 1) / P * row)
    short = predict_step(_chunk(1, M0, "float32", (1000, 0), B, H, Hkv, E, Ev), topo, m)
    assert short["read_s"] == pytest.approx(1001 * row)  # one page: one rank reads them all
    assert short["compute_s"] == pytest.approx(2 * B * H * (E + Ev) * 1001 / m.rate("float32"))
    assert short["merge_bytes"] == full["merge_bytes"] == B * H * (Ev + 1) * 4


@pytest.mark.mpi(min_size=2)
def test_auto_prefill_counts_the_pairs_a_mask_mod_hides(comm, monkeypatch):
    """With a mask_mod, ``variant="auto"`` prices the chunk on its counted visible pairs (the
    function given absolute positions): compared with a dense count written out here."""
    from mpiattn.inference import cache as cache_module
    seen = []
    real = cache_module.choose
    monkeypatch.setattr(cache_module, "choose",
                        lambda spec, topo, machine, pairs, **kw: seen.append(pairs) or
                        real(spec, topo, machine, pairs, **kw))
    Q, K, V = _seq(5)
    n0, C = 30, 17
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]))
    rule = lambda b, h, q, kv: (q + kv) % 3 != 0  # noqa: E731
    used = {}
    cache.prefill(*(mpiattn.shard(x[:, :, n0:n0 + C]) for x in (Q, K, V)), mask_mod=rule,
                  variant="auto", details=used)
    i = np.arange(n0, n0 + C)[:, None]
    j = np.arange(n0 + C)[None, :]
    dense = ((j <= i) & ((i + j) % 3 != 0)).sum(axis=1)
    assert len(seen) == 1 and np.array_equal(seen[0], dense)
    assert used["variant"] in ("pass-kv", "pass-q")


def test_bad_prefill_chunks_fail_alike(comm):
    Q, K, V = _seq(12)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :30]), mpiattn.shard(V[:, :, :30]))
    msgs = []
    for bad in [dict(q=Q[..., :5]), dict(k=K.astype(np.float32)), dict(variant="pass-x")]:
        kw = {"q": mpiattn.shard(Q[:, :, 30:40]), "k": mpiattn.shard(K[:, :, 30:40]),
              "v": mpiattn.shard(V[:, :, 30:40]), "variant": "auto"}
        for name, x in bad.items():
            kw[name] = x if name == "variant" else mpiattn.shard(x[:, :, 30:40])
        try:
            cache.prefill(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
        except (ValueError, TypeError) as exc:
            msgs.append(str(exc))
    got = comm.allgather_obj(msgs)
    assert len(got[0]) == 3 and all(g == got[0] for g in got), got
    assert cache.length == 30


# ------------------------------------------------------------------ files
def _groups(comm):
    """Sub-communicators of other sizes than the run's: the first half and the rest (one rank: itself)."""
    world = MPI.COMM_WORLD
    half = max(1, world.Get_size() // 2)
    return world.Split(0 if world.Get_rank() < half else 1, world.Get_rank())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_save_at_p_load_at_other_p_and_continue(comm, shared_dir, dtype):
    Q, K, V = (x.astype(dtype) for x in _seq(13, L=80))
    path = os.path.join(shared_dir, "cache.h5")
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :40], layout="zigzag"),
                                        mpiattn.shard(V[:, :, :40], layout="zigzag"),
                                        layout="zigzag", page=3)
    cache.append(K[:, :, 40:47], V[:, :, 40:47])
    cache.save(path)
    before = cache.attend(Q[:, :, 45:47])
    ref = reference(Q, K, V, causal=True)
    sub = _groups(comm)
    try:
        loaded = mpiattn.KVCache.load(path, sub)
        assert loaded.length == 47 and loaded.page == 3 and loaded.dtype == np.dtype(dtype)
        again = loaded.attend(Q[:, :, 45:47])
        np.testing.assert_allclose(host(again[0]), host(before[0]), atol=1e-6 if dtype == "float32" else 1e-13)
        for pos in range(47, 80, 11):  # continue: appends and decode steps on the new rank count
            loaded.append(K[:, :, pos:pos + 11], V[:, :, pos:pos + 11])
            out, lse = loaded.attend(Q[:, :, pos + 10:pos + 11])
            tol = 2e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(host(out), ref.out[:, :, pos + 10:pos + 11], atol=tol)
            np.testing.assert_allclose(host(lse), ref.lse[:, :, pos + 10:pos + 11], atol=tol)
    finally:
        sub.Free()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["k"][...], K[:, :, :47])
        assert f.attrs["length"] == 47 and f.attrs["ranks"] == comm.size


def _agreed(comm, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        msg = f"{type(exc).__name__}: {exc}"
    else:
        msg = None
    got = comm.allgather_obj(msg)
    assert got[0] is not None and all(g == got[0] for g in got), got
    return got[0]


def test_bad_cache_files_fail_alike_and_nothing_is_half_written(comm, shared_dir):
    Q, K, V = _seq(14, L=30)
    path = os.path.join(shared_dir, "cache.h5")
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V))
    cache.save(path)
    assert "exists" in _agreed(comm, lambda: cache.save(path))  # no clobbering without force
    if comm.rank == 0:
        with open(path, "rb") as f:
            data = f.read()
        for name, change in [("axes", lambda f: f.attrs.__setitem__("axes", "batch,position,kv_heads,feature")),
                             ("length", lambda f: f.attrs.__setitem__("length", 31)),
                             ("format", lambda f: f.attrs.__setitem__("format", "something else"))]:
            p = os.path.join(shared_dir, f"{name}.h5")
            with open(p, "wb") as f:
                f.write(data)
            with h5py.File(p, "r+") as f:
                change(f)
        with open(os.path.join(shared_dir, "truncated.h5"), "wb") as f:
            f.write(data[: len(data) // 2])
    comm.barrier()
    load = lambda name: (lambda: mpiattn.KVCache.load(os.path.join(shared_dir, name)))  # noqa: E731
    assert "another layout of the cache" in _agreed(comm, load("axes.h5"))
    assert "damaged or unfinished" in _agreed(comm, load("length.h5"))
    assert "not an mpiattn key/value cache" in _agreed(comm, load("format.h5"))
    assert "truncated file" in _agreed(comm, load("truncated.h5"))
    assert "does not exist" in _agreed(comm, load("missing.h5"))
    leftovers = [n for n in os.listdir(shared_dir) if n.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize("variant", ["pass-kv", "pass-q"])
def test_chunked_prefill_with_sinks_softcap_and_alibi(comm, variant):
    """Both variants with every modifier a decode takes: the chunk's rows of the whole sequence's
    float64 torch reference (ALiBi by absolute positions, the sinks in every row)."""
    from helpers import torch_reference, visible_matrix

    pytest.importorskip("torch")
    Q, K, V = _seq(12)
    B, H, L = Q.shape[:3]
    rng = np.random.default_rng(4)
    slopes, sinks = rng.uniform(0.1, 0.4, H), rng.standard_normal(H)
    n0, C = 29, 19
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]), page=3)
    sl = slice(n0, n0 + C)
    kw = dict(window=(8, 0), softcap=2.0, alibi_slopes=slopes, sinks=sinks)
    out, lse = cache.prefill(*(mpiattn.shard(x[:, :, sl], layout="zigzag") for x in (Q, K, V)),
                             layout="zigzag", variant=variant, **kw)
    keys = slice(0, n0 + C)
    vis = visible_matrix(B, C, n0 + C, "bottom-right", (8, 0))[:, None]
    dist = np.abs(np.arange(n0, n0 + C)[:, None] - np.arange(n0 + C)[None, :])
    dO = np.zeros(Q[:, :, sl].shape[:3] + (V.shape[3],))
    ref = torch_reference(Q[:, :, sl], K[:, :, keys], V[:, :, keys], dO, vis,
                          softcap=2.0, bias=-slopes[None, :, None, None] * dist, sinks=sinks)
    np.testing.assert_allclose(host(mpiattn.gather(out, layout="zigzag", root=None)), ref[0], atol=1e-12)
    np.testing.assert_allclose(host(mpiattn.gather(lse, axis=-1, layout="zigzag", root=None)), ref[1],
                               atol=1e-12)


@pytest.mark.parametrize("variant", ["pass-kv", "pass-q"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_chunked_prefill_with_an_attn_mask(comm, variant, kind):
    """Both variants with the chunk's rows of a mask over the cache and the chunk (absolute key
    positions, zigzag rows) and the sinks: the whole sequence's float64 torch reference."""
    from helpers import torch_reference, visible_matrix

    pytest.importorskip("torch")
    Q, K, V = _seq(12)
    B, H, L = Q.shape[:3]
    rng = np.random.default_rng(6)
    n0, C = 29, 19
    sinks = rng.standard_normal(H)
    vis = visible_matrix(B, C, n0 + C, "bottom-right", None)[:, None]
    if kind == "bool":
        mask = rng.random((B, 1, C, n0 + C)) < 0.6
        mask[0, 0, 4] = False
        bias, vis = None, vis & mask
    else:
        mask = np.where(rng.random((1, H, C, n0 + C)) < 0.2, -np.inf, rng.standard_normal((1, H, C, n0 + C)))
        bias = mask
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]), page=3)
    sl = slice(n0, n0 + C)
    zig = lambda x: mpiattn.shard(x, layout="zigzag")  # noqa: E731
    out, lse = cache.prefill(*(zig(x[:, :, sl]) for x in (Q, K, V)), layout="zigzag",
                             variant=variant, sinks=sinks, attn_mask=zig(mask), append=False)
    dO = np.zeros(Q[:, :, sl].shape[:3] + (V.shape[3],))
    ref = torch_reference(Q[:, :, sl], K[:, :, :n0 + C], V[:, :, :n0 + C], dO, vis, bias=bias,
                          sinks=sinks)
    np.testing.assert_allclose(host(mpiattn.gather(out, layout="zigzag", root=None)), ref[0], atol=1e-12)
    np.testing.assert_allclose(host(mpiattn.gather(lse, axis=-1, layout="zigzag", root=None)), ref[1],
                               atol=1e-12)
    with pytest.raises(ValueError, match="span the cache and the chunk"):
        cache.prefill(*(zig(x[:, :, sl]) for x in (Q, K, V)), layout="zigzag", variant=variant,
                      attn_mask=zig(mask[..., :-1]), append=False)


@pytest.mark.parametrize("variant", ["pass-kv", "pass-q"])
def test_chunked_prefill_with_a_score_mod_and_a_mask_mod(comm, variant):
    """Both variants give a score_mod (a relative-position bias, a per-head temperature) and a
    mask_mod absolute positions (chunk row ``i`` at ``n0 + i``), as decode does: the chunk's rows
    of the whole sequence's float64 torch reference; the same through ``score=``."""
    from helpers import torch_reference, visible_matrix

    torch = pytest.importorskip("torch")
    Q, K, V = _seq(13)
    B, H, L = Q.shape[:3]
    rng = np.random.default_rng(7)
    table, temp = rng.standard_normal((H, 2 * L)), 0.5 + rng.random(H)
    mod = mpiattn.ScoreMod(lambda x, b, h, i, j: x * temp[h] + table[h, i - j + L],
                           lambda x, b, h, i, j: temp[h] + 0 * x)
    rule = lambda b, h, i, j: (i % 3 != 0) | (j % 2 == 0)  # noqa: E731
    n0, C = 29, 19
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]), page=3)
    sl = slice(n0, n0 + C)
    zig = lambda x: mpiattn.shard(x, layout="zigzag")  # noqa: E731
    out, lse = cache.prefill(*(zig(x[:, :, sl]) for x in (Q, K, V)), layout="zigzag", variant=variant,
                             window=(12, 0), score_mod=mod, mask_mod=rule, append=False)
    i_abs, j = np.arange(n0, n0 + C)[:, None], np.arange(n0 + C)[None, :]
    vis = visible_matrix(B, C, n0 + C, "bottom-right", (12, 0))[:, None] & rule(0, 0, i_abs, j)
    t_table, t_temp = torch.tensor(table), torch.tensor(temp)
    dO = np.zeros(Q[:, :, sl].shape[:3] + (V.shape[3],))
    ref = torch_reference(Q[:, :, sl], K[:, :, :n0 + C], V[:, :, :n0 + C], dO, vis,
                          score_mod=lambda x, b, h, i, j: x * t_temp[h] + t_table[h, i + n0 - j + L])
    got = host(mpiattn.gather(out, layout="zigzag", root=None))
    np.testing.assert_allclose(got, ref[0], atol=1e-12)
    np.testing.assert_allclose(host(mpiattn.gather(lse, axis=-1, layout="zigzag", root=None)), ref[1],
                               atol=1e-12)
    again, _ = cache.prefill(*(zig(x[:, :, sl]) for x in (Q, K, V)), layout="zigzag", variant=variant,
                             window=(12, 0), score=mpiattn.Score(score_mod=mod, mask_mod=rule),
                             append=False)
    np.testing.assert_array_equal(host(mpiattn.gather(again, layout="zigzag", root=None)), got)
