"""Choosing tiles by whole-step time: the descent over a step whose cost is a known table.

The step's time is given as a function of the tiles (what a CUDA-graph timing returns on a
device), so the descent's choices can be checked exactly, without a GPU.
"""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.backends.torch.step_tuning import MIN_GAIN, descend

# Two products whose best tiles depend on each other (as a product's overlap with the kernel
# next to it does): with b1, a2 is slower than a1; once b2 is chosen, a2 is the fastest.
COSTS = {("a1", "b1"): 1000.0, ("a2", "b1"): 1005.0, ("a3", "b1"): 1100.0,
         ("a1", "b2"): 980.0, ("a2", "b2"): 900.0, ("a3", "b2"): 1100.0}
CANDIDATES = {"a": ["a1", "a2", "a3"], "b": ["b1", "b2"]}


def table_step(calls: list | None = None):
    def step_us(choices):
        if calls is not None:
            calls.append(dict(choices))
        return COSTS[(choices["a"], choices["b"])]
    return step_us


def test_descent_finds_the_pair_that_only_a_second_look_at_the_first_product_shows():
    found = descend({"a": "a1", "b": "b1"}, CANDIDATES, table_step(), budget_s=60)
    assert found.choices == {"a": "a2", "b": "b2"}
    assert (found.start_us, found.best_us) == (1000.0, 900.0)
    assert found.changed == {"a": ("a1", "a2"), "b": ("b1", "b2")}
    assert not found.out_of_time


def test_descent_keeps_the_start_where_nothing_is_faster():
    calls = []
    found = descend({"a": "a2", "b": "b2"}, CANDIDATES, table_step(calls), budget_s=60)
    assert found.choices == {"a": "a2", "b": "b2"} and found.changed == {}
    assert found.rounds == 1  # a round that changed nothing ends it
    # the start twice, then every other tile of each product once, the others' tiles as chosen
    assert calls == [{"a": "a2", "b": "b2"}, {"a": "a2", "b": "b2"}, {"a": "a1", "b": "b2"}, {"a": "a3", "b": "b2"},
                     {"a": "a2", "b": "b1"}]


def test_a_gain_within_the_timings_spread_is_not_taken():
    costs = {"x1": 1000.0, "x2": 1000.0 * (1 - MIN_GAIN / 2), "x3": 1000.0 * (1 - 2 * MIN_GAIN)}
    found = descend({"x": "x1"}, {"x": ["x2"]}, lambda c: costs[c["x"]], budget_s=60)
    assert found.choices == {"x": "x1"}
    found = descend({"x": "x1"}, {"x": ["x2", "x3"]}, lambda c: costs[c["x"]], budget_s=60)
    assert found.choices == {"x": "x3"}


def test_the_budget_stops_the_descent_and_keeps_the_best_so_far():
    ticks = itertools.count()
    calls = []
    # each clock reading is a second later: two trials fit in 2.5 s; the round cut short still takes
    # its fastest (a1), timed again beside the start
    found = descend({"a": "a3", "b": "b1"}, CANDIDATES, table_step(calls), budget_s=2.5,
                    clock=lambda: float(next(ticks)))
    assert found.out_of_time
    assert found.trials == 2
    assert calls == [{"a": "a3", "b": "b1"}] * 2 + [{"a": "a1", "b": "b1"}, {"a": "a2", "b": "b1"},
                                                    {"a": "a1", "b": "b1"}, {"a": "a3", "b": "b1"}]
    assert found.choices == {"a": "a1", "b": "b1"} and found.best_us == 1000.0


def noisy_step(costs: dict[str, float], lucky: dict[str, list[float]]):
    """A step whose timings of tile x are ``lucky[x]`` first, one by one, then its true cost."""
    draws = {x: iter(v) for x, v in lucky.items()}
    return lambda c: next(draws.get(c["x"], iter(())), costs[c["x"]])


def test_a_tile_faster_in_one_lucky_timing_only_is_not_kept():
    """x2 is 1% slower than x1, but its first timing is 1% faster: timed again, it is not taken."""
    found = descend({"x": "x1"}, {"x": ["x2"]}, noisy_step({"x1": 1000.0, "x2": 1010.0}, {"x2": [990.0]}),
                    budget_s=60)
    assert found.choices == {"x": "x1"}
    assert found.refuted == 1 and found.best_us == 1000.0


def test_a_lucky_timing_of_the_start_does_not_hide_a_faster_tile():
    """x1's first timing is 2% low; x2 is truly 1.5% faster than x1. Against that one timing x2
    would never count as faster; against the mean of x1's timings it is taken."""
    found = descend({"x": "x1"}, {"x": ["x2"]}, noisy_step({"x1": 1000.0, "x2": 985.0}, {"x1": [980.0]}),
                    budget_s=60)
    assert found.choices == {"x": "x2"}
    assert found.start_us == 990.0 and found.best_us == 985.0


def test_rounds_bound_the_descent():
    found = descend({"a": "a1", "b": "b1"}, CANDIDATES, table_step(), budget_s=60, rounds=1)
    assert found.rounds == 1 and not found.out_of_time
    assert found.choices == {"a": "a1", "b": "b2"} and found.best_us == 980.0


def test_a_product_changed_and_changed_back_is_not_reported_as_changed():
    # a2 is the best first change (950), then b2 (940), then c2 (930); with b2 and c2, a1 is the
    # fastest again (900): a ends where it began
    costs = {("a1", "b1", "c1"): 1000.0, ("a2", "b1", "c1"): 950.0, ("a1", "b2", "c1"): 990.0,
             ("a1", "b1", "c2"): 995.0, ("a2", "b2", "c1"): 940.0, ("a2", "b1", "c2"): 960.0,
             ("a2", "b2", "c2"): 930.0, ("a1", "b2", "c2"): 900.0}
    found = descend({"a": "a1", "b": "b1", "c": "c1"}, {"a": ["a1", "a2"], "b": ["b1", "b2"], "c": ["c1", "c2"]},
                    lambda c: costs[(c["a"], c["b"], c["c"])], budget_s=60, rounds=4)
    assert found.choices == {"a": "a1", "b": "b2", "c": "c2"} and found.best_us == 900.0
    assert found.changed == {"b": ("b1", "b2"), "c": ("c1", "c2")}


def test_the_fastest_change_of_a_round_is_taken_not_the_first_that_helps():
    """As on the H200: from the start, o's second tile and down's second tile each make the step
    faster, down's far more; with o's second tile, down's no longer helps. Taking o's change first
    (it comes first) would end at 970; taking the fastest change first ends at 900."""
    costs = {("o1", "d1"): 977.0, ("o2", "d1"): 970.0, ("o1", "d2"): 900.0, ("o2", "d2"): 975.0}
    found = descend({"o": "o1", "down": "d1"}, {"o": ["o1", "o2"], "down": ["d1", "d2"]},
                    lambda c: costs[(c["o"], c["down"])], budget_s=60)
    assert found.choices == {"o": "o1", "down": "d2"} and found.best_us == 900.0


@pytest.mark.parametrize("start", [{"a": "a3", "b": "b1"}, {"a": "a1", "b": "b2"}])
def test_every_start_reaches_the_table_minimum(start):
    found = descend(start, CANDIDATES, table_step(), budget_s=60, rounds=3)
    assert found.best_us == min(COSTS.values())


def all_right(x, w, candidates, out, run, **kw):
    """``triton_decode.right_tiles`` where every tile's outputs are torch's (the kernels do not run here)."""
    return list(candidates), {}


def test_the_fused_step_keeps_and_reports_the_tile_the_whole_step_prefers(checkpoint, monkeypatch):
    """FusedDecode.tune on a tiny checkpoint, the device's two timers replaced by known costs and
    every tile's outputs taken as right (the GPU is the boundary): alone, every product's first
    candidate is the fastest; in the step, o's third candidate saves 5%. The engine must run with
    it and report both choices."""
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model

    decoder = load_model(checkpoint("qwen2_vl")).decoder
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    alone_times = itertools.count(1.0)  # each candidate timed alone is slower than the one before
    monkeypatch.setattr(triton_decode, "graph_time_us", lambda calls: float(next(alone_times)))
    monkeypatch.setattr(triton_decode, "right_tiles", all_right)
    preferred = triton_decode.GEMV_CANDIDATES[2]
    monkeypatch.setattr(triton_decode, "step_time_us",
                        lambda step: 950.0 if fused.configs["o"] == preferred else 1000.0)
    fused.tune(step_budget_s=60)

    first = triton_decode.GEMV_CANDIDATES[0]
    assert fused.configs["o"] == preferred
    assert all(c == first for name, c in fused.configs.items() if name != "o")
    o = fused.report["o"]
    assert (o["alone"], o["config"]) == (triton_decode._config_name(first), triton_decode._config_name(preferred))
    assert o["us"] == o["candidates_us"][o["config"]] and o["gb_s"] == round(o["mb"] / o["us"] * 1e3, 1)
    assert all("alone" not in r for name, r in fused.report.items() if name != "o")
    assert (fused.step_report["alone_us"], fused.step_report["in_step_us"]) == (1000.0, 950.0)
    assert not fused.step_report["out_of_time"] and fused.step_report["trials"] > 0


def test_the_step_tries_only_each_products_fastest_tiles_alone(checkpoint, monkeypatch):
    """A tile outside a product's STEP_CANDIDATES fastest alone is never timed in the step, even
    where it would have been the step's fastest; the descent runs STEP_ROUNDS rounds at most."""
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.backends.torch.step_tuning import STEP_CANDIDATES, STEP_ROUNDS
    from edgeinfer.models.loader import load_model

    decoder = load_model(checkpoint("qwen2_vl")).decoder
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    alone_times = itertools.count(1.0)  # candidates alone rank in their listed order
    monkeypatch.setattr(triton_decode, "graph_time_us", lambda calls: float(next(alone_times)))
    monkeypatch.setattr(triton_decode, "right_tiles", all_right)
    candidates = triton_decode.GEMV_CANDIDATES
    tried = []
    # every trial is 2% faster than the one before, so each is kept and every round changes something
    trials = itertools.count(0)

    def step_us(step):
        tried.append(dict(fused.configs))
        if fused.configs["o"] == candidates[STEP_CANDIDATES]:  # the step's fastest, outside the cut
            return 1.0
        return 1000.0 * 0.98 ** next(trials)

    monkeypatch.setattr(triton_decode, "step_time_us", step_us)
    fused.tune(step_budget_s=600)
    for name in fused.configs:  # each product's fastest tiles alone, all of them, and no other
        assert {choices[name] for choices in tried} == set(candidates[:STEP_CANDIDATES])
    assert fused.step_report["rounds"] == STEP_ROUNDS


def test_a_tile_the_check_refuses_is_never_timed_and_a_product_with_none_right_stops_the_step(checkpoint,
                                                                                                monkeypatch):
    """The tiles ``right_tiles`` refuses (here o's fastest alone) are not timed, alone or in the
    step, and are reported with why; where every tile of a product is refused, tuning raises, and
    the engine then decodes through the compiled layers."""
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model

    decoder = load_model(checkpoint("qwen2_vl")).decoder
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    candidates = triton_decode.GEMV_CANDIDATES
    refused = {"o": candidates[:1]}

    products = {ws[0].data_ptr(): name for name, (ws, _) in fused._products().items()}

    def check(x, w, tiles, out, run, **kw):
        name = products[w.data_ptr()]  # the check runs on a product's first layer's weight
        wrong = [t for t in tiles if t in refused.get(name, ())]
        return [t for t in tiles if t not in wrong], {triton_decode._config_name(t): "row 0, output 3: 1 where 0"
                                                     for t in wrong}

    timed = []
    monkeypatch.setattr(triton_decode, "right_tiles", check)
    monkeypatch.setattr(triton_decode, "graph_time_us", lambda calls: float(len(timed.append(None) or timed)))
    monkeypatch.setattr(triton_decode, "step_time_us",
                        lambda step: timed.append(dict(fused.configs)) or 1000.0)
    fused.tune(step_budget_s=60)
    o = fused.report["o"]
    name = triton_decode._config_name(candidates[0])
    assert fused.configs["o"] != candidates[0] and name not in o["candidates_us"]
    assert o["wrong_outputs"] == {name: "row 0, output 3: 1 where 0"}
    assert all(step["o"] != candidates[0] for step in timed if isinstance(step, dict))
    assert len(o["candidates_us"]) == len(candidates) - 1 and "wrong_outputs" not in fused.report["qkv"]

    refused["down"] = candidates
    fresh = triton_decode.FusedDecode(decoder)
    with pytest.raises(RuntimeError, match="every tile of the fused step's down product gave wrong outputs"):
        fresh.tune(step_budget_s=0)


def _rows_setup(checkpoint, monkeypatch, cost, budget_s: float, cache=None):
    """A FusedDecode on a tiny checkpoint whose few-row descent runs here, tuned at batch 1 with
    ``budget_s`` and ``cache``: six staged tiles said to fit every product (which ones fit is
    :mod:`staged`'s, checked in tests/test_quant_staged.py), every tile's outputs right but one (the
    GPU is the boundary), and the step's time ``cost(choices)`` for the tiles the layers run at 8 rows
    (1,000 µs for every batch-1 step). Returns the FusedDecode, the tiles and every choice timed at 8 rows."""
    import itertools

    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model
    from edgeinfer.quant.staged import StagedGemvConfig

    decoder = load_model(checkpoint("qwen2_vl")).decoder
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    tiles = [StagedGemvConfig(warps, split) for warps in (1, 2, 4) for split in (1, 2)]
    monkeypatch.setattr(triton_decode.staged, "tiles_that_fit", lambda w, dtype, glu: list(tiles))
    monkeypatch.setattr(triton_decode.staged, "unfit", lambda w, dtype, glu, config: None)
    monkeypatch.setattr(triton_decode, "right_tiles", lambda x, w, candidates, out, run, **kw: (
        [t for t in candidates if t != tiles[5]], {triton_decode._config_name(tiles[5]): "row 0: 1 where 0"}))
    timed = []

    def step_us(step):
        if 8 not in fused._row_tiles:  # a batch-1 step
            return 1000.0
        choices = dict(fused._row_tiles[8])  # what the layers run at 8 rows while the step is timed
        timed.append(choices)
        return cost(choices)

    alone_times = itertools.count(1.0)
    monkeypatch.setattr(triton_decode, "graph_time_us", lambda calls: float(next(alone_times)))
    monkeypatch.setattr(triton_decode, "step_time_us", step_us)
    fused.tune(step_budget_s=budget_s, cache=cache)
    return fused, tiles, timed


def test_the_few_row_layers_keep_the_tiles_their_whole_step_prefers(checkpoint, monkeypatch):
    """At 2 to 16 rows the tiles chosen alone (the few-row tuner's, unfused) are a start: the step of
    8 rows is timed with each product's other staged tiles, and down's fourth, 10% faster in the
    step, is kept and reported; a tile whose fused outputs are not torch's is never timed."""
    from edgeinfer.backends.torch import triton_decode

    preferred = {}
    fused, tiles, timed = _rows_setup(checkpoint, monkeypatch,
                                      lambda choices: 900.0 if choices["down"] == preferred["down"] else 1000.0, 60)
    preferred["down"] = tiles[3]
    start = dict.fromkeys(fused.ROW_PRODUCTS, tiles[0])
    chosen = fused._rows_in_step(8, start)
    assert chosen == {**start, "down": tiles[3]}
    report = fused.rows_step_report[8]
    assert (report["alone_us"], report["in_step_us"]) == (1000.0, 900.0)
    assert report["changed"] == {"down": [triton_decode._config_name(tiles[0]), triton_decode._config_name(tiles[3])]}
    assert all(tiles[5] not in choices.values() for choices in timed)
    for name in fused.ROW_PRODUCTS:  # every right tile of every product was tried
        assert {choices[name] for choices in timed} == set(tiles[:5])


def test_the_few_row_tiles_are_kept_across_processes_by_row_tile_and_start(checkpoint, monkeypatch, tmp_path):
    """The descent's tiles go into the tile cache: the next process with the same start at the same
    row tile times nothing and takes them; another start, or a longer budget, times again."""
    from edgeinfer import tile_cache
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.tile_cache import TileCache

    monkeypatch.setattr(triton_decode, "device_identity", lambda device: {"gpu": "NVIDIA H200", "test": True})
    preferred = {}
    cost = lambda choices: 900.0 if choices["o"] == preferred["o"] else 1000.0  # noqa: E731
    fused, tiles, timed = _rows_setup(checkpoint, monkeypatch, cost, 8, TileCache(tmp_path))
    preferred["o"] = tiles[4]
    start = dict.fromkeys(fused.ROW_PRODUCTS, tiles[1])
    first = fused._rows_in_step(8, start)
    assert first["o"] == tiles[4] and timed

    tile_cache.forget_reads()
    again, _, timed_again = _rows_setup(checkpoint, monkeypatch, cost, 8, TileCache(tmp_path))
    assert again._rows_in_step(8, start) == first and not timed_again
    assert again.rows_step_report[8] == {**fused.rows_step_report[8], "from_cache": True}

    for budget, other_start in [(60, start), (8, dict.fromkeys(fused.ROW_PRODUCTS, tiles[2]))]:
        fresh, _, timed_fresh = _rows_setup(checkpoint, monkeypatch, cost, budget, TileCache(tmp_path))
        assert fresh._rows_in_step(8, other_start)["o"] == tiles[4] and timed_fresh, (budget, other_start)
