"""The cost model, the machines it knows, and how ``auto`` and ``hybrid`` choose with it."""

import json
import os
import resource
import sys

import numpy as np
import pytest

import mpiattn
from mpiattn import cli
from mpiattn.comm.topology import Topology
from mpiattn.layouts import Layout, all_segments, positions
from mpiattn.strategies import AttentionSpec, Options, machines, model, registry
from mpiattn.strategies.hybrid import Hybrid

from helpers import run_group


def _spec(N=4096, H=8, Hkv=8, E=64, causal=False, dtype="float32", **kw):
    o = Options(causal=causal, layout="zigzag" if causal else "contiguous", **kw)
    return AttentionSpec.from_shapes((1, H, N, E), (1, Hkv, N, E), (1, Hkv, N, E), dtype, o)


def test_names_and_configurations():
    assert registry.get("hybrid:2x2") == Hybrid(2, 2)
    assert registry.get("hybrid:2x2:ring-first").placement == "ring-first"
    assert registry.needs_choice("auto") and registry.needs_choice("hybrid")
    assert not registry.needs_choice("hybrid:2x2") and not registry.needs_choice("ring")
    for bad, match in (("hybrid:2x", "expected hybrid:UxR"), ("ring:2", "takes no configuration"),
                       ("auto:2", "unknown strategy"), ("hybrid:0x4", "must be >= 1"),
                       ("hybrid:2x2:sideways", "placement"), ("rings", "unknown strategy")):
        with pytest.raises(ValueError, match=match):
            registry.get(bad)
    assert "hybrid:2x2" in registry.variants(4) and "hybrid:3x1" not in registry.variants(4)
    # what the tests run at 1-4 ranks (the contract suite takes its strategies from here)
    assert {"ring", "allgather", "ulysses", "materialized", "double-ring", "hybrid:1x1", "hybrid:2x2",
            "hybrid:1x4", "hybrid:4x1", "hybrid:3x1", "hybrid:2x2:ring-first"} <= {
        name for P in range(1, 5) for name in registry.variants(P)}


def test_hybrid_splits_and_what_they_support():
    topo = Topology.blocks(4, 2)
    assert [c.label for c in Hybrid().candidates(_spec(H=8, Hkv=2), topo)] == \
        ["hybrid:1x4", "hybrid:2x2", "hybrid:4x1"]  # Hkv = 2 < u = 4: key/value heads replicated
    # H = 6 over 4: 1 or 2 query heads a member (uneven), Hkv = 3 replicated where shared
    assert [c.label for c in Hybrid().candidates(_spec(H=6, Hkv=3), topo)] == \
        ["hybrid:1x4", "hybrid:2x2", "hybrid:4x1"]
    assert [c.label for c in Hybrid().candidates(_spec(H=2, Hkv=1), topo)] == ["hybrid:1x4", "hybrid:2x2"]
    assert "fewer than the 4 ranks" in Hybrid(4, 1).supports(_spec(H=3, Hkv=3), topo)
    assert "needs U x R = 2 ranks" in Hybrid(2, 1).supports(_spec(), topo)
    groups, rings = Hybrid(2, 2).grid(Topology.parse("0,1,0,1", 4))
    assert groups == [[0, 2], [1, 3]] and rings == [[0, 1], [2, 3]]  # head groups inside the nodes
    groups, _ = Hybrid(2, 2, "ring-first").grid(Topology.parse("0,1,0,1", 4))
    assert groups == [[0, 1], [2, 3]]


def test_auto_takes_the_fastest_prediction_that_fits():
    topo = Topology.blocks(16, 8)
    machine = machines.PROFILES["h200-nvlink-ndr"]
    spec = _spec(N=1 << 17, H=32, Hkv=8, E=128, causal=True, dtype="float16")
    chosen, why = registry.resolve(spec, topo, 512, machine)
    rows = registry.table(spec, topo, 512, machine)
    pickable = [r for r in rows if r.prediction is not None and r.pickable and r.fits]
    best = min(pickable, key=lambda r: r.prediction.fwdbwd_s)
    assert chosen.label == best.label and [r.label for r in rows if r.auto] == [best.label]
    assert machine.name in why and "parallel efficiency" in why
    small = machines.Machine("tiny", machine.inside, machine.between, machine.rates, memory=1.0)
    assert "no candidate fits" in registry.resolve(spec, topo, 512, small)[1]
    hyb = registry.resolve(_spec(N=1 << 17, H=32, Hkv=8, E=128, causal=True, dtype="float16",
                                 strategy="hybrid"), topo, 512, machine)[0]
    assert hyb.name == "hybrid" and hyb.u is not None


def test_the_model_by_hand():
    """One ring step on one node: compute, transfers hidden up to the overlap."""
    link = machines.Link(1e-5, 1e9)
    m = machines.Machine("m", link, link, {"float32": 1e9}, backward_ratio=0.5, overlap=0.0)
    spec, topo = _spec(N=1024, H=1, Hkv=1, E=16), Topology.blocks(2, 2)
    p = model.predict(registry.get("ring"), spec, topo, 1024, m)
    flops = 2 * 1024 * 1024 * 32
    step = 512 * 32 * 4  # m rows of k and v, float32
    assert p.compute_s == pytest.approx(flops / 2 / 1e9)
    assert p.forward_s == pytest.approx(flops / 2 / 1e9 + 1e-5 + step / 1e9)
    assert p.backward_s == pytest.approx(2.5 * flops / 2 / 0.5e9 + 1e-5 + 2 * step / 1e9)
    assert p.ideal_s == pytest.approx((flops + 2.5 * flops / 0.5) / 1e9 / 2)
    hidden = model.predict(registry.get("ring"), spec, topo, 1024, machines.Machine(
        "m", link, link, {"float32": 1e9}, backward_ratio=0.5, overlap=1.0))
    assert hidden.forward_s == pytest.approx(p.compute_s)  # 17 us of transfer behind 1 ms of compute
    causal = np.diff(model.RowPairs.of_spec(_spec(N=8, causal=True)).before(np.arange(9)))
    assert causal.tolist() == list(range(1, 9))
    window = np.diff(model.RowPairs.of_spec(_spec(N=8, window=(2, 1))).before(np.arange(9)))
    assert window.tolist() == [2, 3, 4, 4, 4, 4, 4, 3]


@pytest.mark.parametrize("N, M", [(1, 1), (13, 13), (13, 5), (5, 13), (40, 17)])
@pytest.mark.parametrize("rules", [dict(), dict(causal=True), dict(causal="bottom-right"),
                                   dict(window=(3, None)), dict(window=(None, 2)), dict(window=(0, 0)),
                                   dict(causal=True, window=(4, 0)), dict(causal="bottom-right", window=(6, 1)),
                                   dict(window=(100, 100))])
def test_row_pairs_in_closed_form_are_the_rules_counted_row_by_row(N, M, rules):
    """RowPairs.of_spec sums the causal and window rules without an array of N rows: the same
    as MaskSpec.keys_per_row row by row, and per rank under every layout."""
    o = Options(layout="contiguous", **rules)
    spec = AttentionSpec.from_shapes((1, 1, N, 4), (1, 1, M, 4), (1, 1, M, 4), "float32", o)
    per_row = spec.mask.keys_per_row(N, M)
    closed, counted = model.RowPairs.of_spec(spec), model.RowPairs.counted(per_row)
    for pairs in (closed, counted):
        assert np.diff(pairs.before(np.arange(N + 1))).tolist() == per_row.tolist()
        assert pairs.total == per_row.sum()
    explicit = Layout([[(N - 1, N)], [(0, N - 1)], []]) if N > 1 else Layout([[(0, 1)], [], []])
    for P, layout in ((1, "contiguous"), (3, "contiguous"), (3, "zigzag"), (3, explicit)):
        want = [per_row[positions(s)].sum() for s in all_segments(N, P, layout)]
        assert closed.per_rank(P, layout).tolist() == want
        assert counted.per_rank(P, layout).tolist() == want


def test_phases_count_nodes_as_the_ranks_do():
    """The busiest rank of a collective or a ring, counted rank by rank here, on uneven and
    interleaved nodes: the model's vectorised counts agree."""
    from mpiattn.strategies.base import ring_phase, spread_phase

    topo = Topology.parse("0,1,0,1,1,2,2", 7)  # nodes {0, 2}, {1, 3, 4}, {5, 6}
    for groups in ([[0, 1, 2, 3, 4, 5, 6]], [[0, 2, 5], [1, 3, 6]], [[0, 2], [1, 3], [5, 6]]):
        worst = max((sum(topo.node_of(b) != topo.node_of(a) for b in g), sum(
            topo.node_of(b) == topo.node_of(a) and b != a for b in g)) for g in groups for a in g)
        spanning = [a for g in groups for a in g if len({topo.node_of(b) for b in g}) > 1]
        sharing = max([sum(topo.node_of(a) == n for a in spanning) for n in range(3)] + [1])
        p = spread_phase(topo, groups, 10.0, 4)
        assert (p.between, p.inside, p.sharing, p.messages) == (10 * worst[0], 10 * worst[1], sharing, 4)
        edges = [(a, g[(i + 1) % len(g)]) for g in groups for i, a in enumerate(g) if len(g) > 1]
        senders = [a for a, b in edges if topo.node_of(a) != topo.node_of(b)]
        sharing = max([sum(topo.node_of(a) == n for a in senders) for n in range(3)] + [1])
        r = ring_phase(topo, groups, 5.0, 2, 3)
        assert (r.between, r.inside, r.sharing) == ((10.0, 0.0) if senders else (0.0, 10.0)) + (sharing,)
        assert (r.messages, r.steps, r.overlap) == (6, 2, True)


def test_machine_files_round_trip(tmp_path):
    path = tmp_path / "m.json"
    machines.PROFILES["cpu-node"].save(str(path))
    assert machines.load(str(path)) == machines.PROFILES["cpu-node"]
    for text, match in (("{}", "not a machine"), ("{", "cannot read")):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            machines.load(str(path))
    with pytest.raises(ValueError, match="neither a profile"):
        machines.load(str(tmp_path / "missing.json"))
    for m in machines.PROFILES.values():  # every number cites its source
        assert {"inside", "between", "rates", "backward_ratio", "overlap", "memory",
                "memory_bandwidth"} <= set(m.sources)


def test_a_call_names_its_machine(comm, monkeypatch):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
    used = {}
    mpiattn.attention(q, q[:, :1], q[:, :1], machine="h200-nvlink-ndr", details=used)
    assert "h200-nvlink-ndr" in used["strategy_reason"]
    monkeypatch.setenv(machines.MACHINE_VARIABLE, "h200-nvlink-ndr")
    mpiattn.attention(q, q[:, :1], q[:, :1], details=used)
    assert "h200-nvlink-ndr" in used["strategy_reason"]
    monkeypatch.setenv(machines.MACHINE_VARIABLE, "cpu-node" if comm.rank == 0 else "h200-nvlink-ndr")
    if comm.size > 1:
        with pytest.raises(ValueError, match="ranks disagree on the cost model's machine"):
            mpiattn.attention(q, q[:, :1], q[:, :1])
    monkeypatch.delenv(machines.MACHINE_VARIABLE)
    path = "/nonexistent/mpiattn-machine.json"  # the same option on every rank
    with pytest.raises(ValueError, match="neither a profile"):
        mpiattn.attention(q, q[:, :1], q[:, :1], machine=path)
    with pytest.raises(ValueError, match="neither a profile"):  # its engine speeds decide auto
        mpiattn.attention(q, q[:, :1], q[:, :1], machine=path, strategy="ring")
    mpiattn.attention(q, q[:, :1], q[:, :1], machine=path, strategy="ring", engine="native")  # not read


def test_plan_marks_auto_and_prints_json(comm, capsys):
    argv = ["plan", "--seq", "65536", "--heads", "32", "--kv-heads", "8", "--dim", "128", "--causal",
            "--nodes", "4", "--ranks-per-node", "8", "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if comm.rank:
        assert out == ""
        return
    plan = json.loads(out)
    rows = [r for r in plan["rows"] if r["supported"]]
    auto = [r for r in rows if r["auto"]]
    assert len(auto) == 1 and auto[0]["strategy"] == plan["auto"]
    assert auto[0]["fwdbwd_s"] == min(r["fwdbwd_s"] for r in rows if r["pickable"] and r["fits"])
    assert {"hybrid:8x4", "ring", "double-ring"} <= {r["strategy"] for r in rows}
    assert all(0 < r["efficiency"] <= 1 for r in rows)
    assert cli.main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "<- auto" in table and f"auto: {plan['auto']}" in table


def test_plan_refuses_bad_machines(comm, capsys, tmp_path):
    bad = ["plan", "--seq", "64", "--heads", "2", "--dim", "8", "--calibration", str(tmp_path / "x.json")]
    assert cli.main(bad) == 2
    assert cli.main(["plan", "--seq", "64", "--heads", "3", "--kv-heads", "2", "--dim", "8"]) == 2
    err = capsys.readouterr().err
    assert comm.rank or ("neither a profile" in err and "multiple of --kv-heads" in err)


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def test_calibrate_writes_a_machine_auto_can_use(comm, capsys, shared_dir):
    path = f"{shared_dir}/machine.json"
    argv = ["calibrate", "-o", path, "--megabytes", "1", "--rows", "64", "--heads", "1", "--dim", "8",
            "--repeat", "1", "-q"]
    assert cli.main(argv) == 0
    m = machines.load(path)
    assert m.inside.latency_s > 0 and m.inside.bandwidth > 0 and m.between.bandwidth > 0
    assert all(m.rates[d] > 0 for d in ("float64", "float32", "float16", "bfloat16"))
    assert m.memory > 0 and m.memory_bandwidth > 0 and "measured" in m.sources["rates"]
    if comm.topology.n_nodes == 1:
        assert "not measured" in m.sources["between"]
    if comm.size > 1:
        assert m.sources["inside" if comm.topology.uniform and comm.topology.sizes[0] > 1 else "between"] \
            .startswith("measured")
    q = np.ones((1, 2, 4, 4), np.float32)
    used = {}
    mpiattn.attention(q, q, q, machine=path, details=used)
    assert m.name in used["strategy_reason"]
    dtypes = {"float64", "float32", "float16"} | ({"bfloat16"} if _has_ml_dtypes() else set())
    assert set(m.engines["native"]) == dtypes  # every engine that runs here, in every dtype
    assert all(f > 0 and b > 0 for by in m.engines.values() for f, b in by.values())
    assert "measured" in m.sources["engines"] and used["engine_reason"].startswith("auto: ")
    assert used["engine"] in m.engines


def test_plan_predicts_decode_and_prefill(comm, capsys):
    argv = ["plan", "--seq", "65536", "--heads", "8", "--dim", "128", "--dtype", "float32", "--nodes", "2",
            "--ranks-per-node", "4", "--cache", "262144", "--chunk", "2048", "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if comm.rank:
        return
    inf = json.loads(out)["inference"]
    d, f = inf["decode"], inf["prefill"]
    m = machines.PROFILES["h200-nvlink-ndr"]
    read = (262144 + 1) / 8 * 8 * 256 * 4 / m.memory_bandwidth  # each rank: an eighth of the keys
    assert d["read_s"] == pytest.approx(read) and d["step_s"] == pytest.approx(max(read, d["compute_s"])
                                                                              + d["merge_s"])
    assert 1 < d["speedup"] <= 8 and d["merge_bytes"] == 8 * 129 * 4
    assert f["variant"] in ("pass-kv", "pass-q") and f["one_rank_s"] > min(f["pass_kv_s"], f["pass_q_s"])


def test_auto_counts_the_pairs_a_mask_hides(comm, monkeypatch):
    """The cost model's pairs of a call with an attn_mask and a mask_mod: each rank counts its
    rows, gathered in global order; compared with the dense count written out here."""
    from mpiattn.strategies import problem

    B, H, N, E = 2, 2, 45, 4
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((B, H, N, E)) for _ in range(3))
    am = rng.random((1, H, N, N)) < 0.6

    def quarters(b, h, i, j):
        return (i // 12 == j // 12) | (h + b == 0)

    seen = []
    real = problem.registry.resolve
    monkeypatch.setattr(problem.registry, "resolve",
                        lambda *a, pairs=None, **kw: seen.append(pairs) or real(*a, pairs=pairs, **kw))
    sq = lambda x: mpiattn.shard(x, axis=-2, comm=comm, layout="zigzag")  # noqa: E731
    mpiattn.attention(sq(q), sq(k), sq(v), comm=comm, causal=True, layout="zigzag",
                      attn_mask=sq(am), mask_mod=quarters)
    b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(N), np.arange(N))
    dense = (j <= i) & am & quarters(b, h, i, j)
    assert np.allclose(seen[-1], dense.sum(-1).mean((0, 1)))
    mpiattn.attention(sq(q), sq(k), sq(v), comm=comm, causal=True, layout="zigzag", strategy="ring",
                      mask_mod=quarters)
    assert seen[-1] is None  # no choice to make: nothing counted


def test_counted_pairs_of_a_long_call_are_an_estimate():
    from mpiattn.masks import MaskSpec
    from mpiattn.masks.counts import key_step_for, visible_keys
    from mpiattn.masks.modifiers import Modifiers

    n, m = 3000, 50_000
    mods = Modifiers(mask_mod=lambda b, h, i, j: (i * 16 // n) == (j * 16 // m), B=1, H=1)
    step = key_step_for(n, m, mods, 2**20)
    assert step > 100
    est = visible_keys(MaskSpec(), mods, np.arange(n), m, key_step=step)
    assert np.allclose(est, m / 16, rtol=0.05), (est.min(), est.max())


#: Sizes ``plan`` accepts (on top of ``--seq 1024 --heads 8 --dim 64``), each a real cluster or the
#: parser's largest: a plan of any of them returns (at 2**31 heads, 1000 nodes, 65536 ranks it did
#: not: a list of every head, a model quadratic in the ranks).
PLAN_SIZES = [["--heads", "2147483647"], ["--heads", "2147483647", "--kv-heads", "1"],
              ["--nodes", "1000"], ["--nodes", "8192"], ["--ranks-per-node", "65536"],
              ["--seq", "2147483647", "--causal", "--window", "2147483647,0", "--nodes", "1000"],
              ["--seq", "2147483647", "--kv-seq", "2147483647", "--batch", "2147483647", "--dim",
               "2147483647", "--value-dim", "2147483647", "--block-size", "2147483647", "--cache",
               "2147483647", "--new-tokens", "2147483647", "--chunk", "2147483647"]]
#: Sizes ``plan`` refuses at once, exit 2: more ranks than it models.
PLAN_REFUSED = [(["--nodes", "2147483647"], "--nodes: must be <= 65536"),
                (["--ranks-per-node", "2147483647"], "--ranks-per-node: must be <= 65536"),
                (["--nodes", "8193"], "65544 ranks; plan models at most 65536")]
_PLAN_CHILD = """
import json, sys
from mpiattn.cli import parser, plan
for extra in json.loads(sys.argv[1]):
    args = parser.build_parser("plan").parse_args(["plan", "--seq", "1024", "--heads", "8", "--dim", "64",
                                                   *extra])
    print(plan.build(args)["auto"], flush=True)
"""


def _small_address_space():
    """In the child: at most 8 GiB of address space (a plan that lists what grows fails fast)."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_plan_of_any_size_returns_and_too_many_ranks_are_refused(serial_only):
    """Every size in PLAN_SIZES is planned (in a child process of bounded memory and time: no
    timing beyond "it returns"); PLAN_REFUSED are one usage line each, exit 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    code, out, err = run_group([sys.executable, "-c", _PLAN_CHILD, json.dumps(PLAN_SIZES)], 20,
                               preexec_fn=_small_address_space, env=env)
    assert code == 0, err
    assert len(out.split()) == len(PLAN_SIZES)
    for extra, message in PLAN_REFUSED:
        code, out, err = run_group([sys.executable, "-m", "mpiattn", "plan", "--seq", "1024", "--heads", "8",
                                    "--dim", "64", *extra], 20, preexec_fn=_small_address_space, env=env)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert out == "" and err.count("error:") == 1
