"""Linear layers routed by measurement (draftsmith.runtime.gemm): the transposed and packed forms
compute F.linear's products, the decision follows the timings (faked here), and only the
measured row counts are rerouted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.runtime import gemm


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", ["transposed", "packed"])
def test_each_form_equals_linear(form, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    x = torch.randn(1, rows, 32, generator=gen)
    if form == "transposed":
        got = gemm.transposed_linear(x, w, b)
        assert got.is_contiguous()
    else:
        packed = gemm.pack(w, rows)
        if packed is None:
            pytest.skip("no oneDNN linear in this torch build")
        got = gemm.packed_linear(x, packed, b)
    assert got.shape == (1, rows, 48)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32, bias=False)
        self.b = torch.nn.Linear(16, 32, bias=False)  # same shape as a: one group
        self.c = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.c(self.a(x) + self.b(x))


def test_no_packed_form_where_onednn_cannot_take_the_weight():
    assert gemm.pack(torch.zeros(4, 4, dtype=torch.float64), 1) is None


def fake_times(monkeypatch, faster: dict, form: str = "transposed"):
    """_pass_seconds faked: `form` takes 0.5 of linear's time for the (in-features, rows) pairs
    in `faster`, 1.0 elsewhere (every other form 1.0 too); the rows each call measured are
    recorded."""
    seen = []

    def fake(name, group, x):
        seen.append((group.shape, x.shape[0]))
        if name == form and x.shape[0] in faster.get(group.shape[1], ()):
            return 0.5
        return 1.0

    monkeypatch.setattr(gemm, "_pass_seconds", fake)
    return seen


def test_route_follows_the_measurement(monkeypatch):
    torch.manual_seed(0)
    model = Tiny()
    x3, x4 = torch.randn(1, 3, 16), torch.randn(1, 4, 16)
    want3, want4 = model(x3), model(x4)
    seen = fake_times(monkeypatch, {16: {3}})
    table = gemm.route(model, [1, 3, 4, 500])
    # 500 rows is a prefill: never measured, never rerouted
    assert {r for _, r in seen} == {1, 3, 4}
    routes = {(tuple(t["shape"]), t["rows"]): t["route"] for t in table}
    assert routes[((32, 16), 3)] == "transposed"
    assert routes[((32, 16), 1)] == routes[((32, 16), 4)] == "linear"
    assert all(routes[((8, 32), r)] == "linear" for r in (1, 3, 4))
    assert [t["modules"] for t in table if t["shape"] == [32, 16]] == [2, 2, 2]
    assert "forward" in model.a.__dict__ and "forward" in model.b.__dict__
    assert "forward" not in model.c.__dict__
    calls = []
    real = gemm.transposed_linear
    monkeypatch.setattr(gemm, "transposed_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(model(x3), want3, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # a and b at 3 rows
    torch.testing.assert_close(model(x4), want4)
    assert len(calls) == 2  # 4 rows: F.linear everywhere
    # times are per group: (a, b) and c, 1 s each with F.linear
    assert "1 rows: all linear, 2000.0 -> 2000.0 ms" in gemm.summary(table)
    assert "3 rows: 2/3 transposed, 2000.0 -> 1500.0 ms" in gemm.summary(table)
    assert not any("packed_weight" in m.__dict__ for m in model.modules())  # none chosen
    gemm.unroute(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_packed_form_is_kept_where_it_was_faster(monkeypatch):
    """The packed copy of a group's weights stays where the packed form was chosen and goes
    elsewhere; the routed model still computes F.linear's outputs; unroute drops the copies."""
    torch.manual_seed(2)
    model = Tiny()
    x3 = torch.randn(1, 3, 16)
    want = model(x3)
    fake_times(monkeypatch, {16: {3}}, form="packed")
    table = gemm.route(model, [1, 3])
    if not any("packed_ms" in t for t in table):
        pytest.skip("no oneDNN linear in this torch build")
    assert {(tuple(t["shape"]), t["rows"]): t["route"] for t in table}[((32, 16), 3)] == "packed"
    assert "packed_weight" in model.a.__dict__ and "packed_weight" not in model.c.__dict__
    assert "3 rows: 2/3 packed, 2000.0 -> 1500.0 ms" in gemm.summary(table)
    with torch.inference_mode():
        torch.testing.assert_close(model(x3), want, rtol=1e-5, atol=1e-5)
    gemm.unroute(model)
    assert not any("packed_weight" in m.__dict__ for m in model.modules())


def test_near_tie_keeps_linear(monkeypatch):
    def fake(name, group, x):
        return 0.95 if name != "linear" else 1.0  # within the margin

    monkeypatch.setattr(gemm, "_pass_seconds", fake)
    model = Tiny()
    table = gemm.route(model, [1, 2])
    assert {t["route"] for t in table} == {"linear"}
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_route_measures_for_real():
    """Unfaked: every group gets both times for every row count, and whatever is chosen, the
    model's outputs stay F.linear's up to rounding."""
    torch.manual_seed(1)
    model = Tiny()
    x = torch.randn(1, 2, 16)
    want = model(x)
    table = gemm.route(model, range(1, 4), reps=1)
    assert len(table) == 2 * 3
    assert all(t["linear_ms"] > 0 and t["transposed_ms"] > 0 for t in table)
    assert all(t.get("packed_ms", 1) > 0 for t in table)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_a_known_row_count_is_not_measured_again(monkeypatch):
    """A job that meets a new row count (a smaller last batch) measures only that one and keeps
    what it chose for the others."""
    model = Tiny()
    seen = fake_times(monkeypatch, {16: {3}})
    first = gemm.route(model, [3])
    seen.clear()
    table = gemm.route(model, [3, 5], known=first)
    assert {r for _, r in seen} == {5}
    routes = {(tuple(t["shape"]), t["rows"]): t["route"] for t in table}
    assert routes[((32, 16), 3)] == "transposed" and routes[((32, 16), 5)] == "linear"
    assert len(table) == 2 * 2
