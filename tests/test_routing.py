"""The one router (hf_invisiblelora/model/routing.py): what a module computes in each pass kind, whatever
the order the parts were installed in; only in the context's passes; nothing left after."""

import types

import pytest
import torch

from hf_invisiblelora.model.context import PassContext
from hf_invisiblelora.model.routing import ALL, LORA, draft


def tagged(tag):
    return lambda original, x: original(x) + tag


@pytest.mark.parametrize("order", ["packed first", "drafter first"])
def test_each_pass_kind_takes_its_route(order):
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    plain = layer(x)
    context = PassContext(lambda: True)
    int4, other = types.SimpleNamespace(key="/torch.int4"), types.SimpleNamespace(key="/vocab8")
    parts = [{layer: (ALL, tagged(1))}, {layer: (draft(int4.key), tagged(100))}]
    if order == "drafter first":
        parts.reverse()
    start = torch.zeros(2, dtype=torch.long)
    with context.router.routing(parts[0]), context.router.routing(parts[1]):
        assert torch.equal(layer(x), plain)  # no pass running: the layer as it is
        for drafter, tag in ((None, 1), (int4, 100), (other, 1)):
            with context.running(start, 1, 1, drafter=drafter):
                assert torch.allclose(layer(x), plain + tag)
        assert context.router.route_for(layer, int4) is not context.router.route_for(layer, None)
    assert "forward" not in vars(layer) and torch.equal(layer(x), plain)


def test_lora_route_and_errors():
    layer = torch.nn.Linear(3, 3)
    x, start = torch.randn(2, 3), torch.zeros(2, dtype=torch.long)
    context = PassContext(lambda: False)  # another thread owns the model: nothing is routed
    with context.router.routing({layer: (LORA, tagged(5))}):
        with context.running(start, 1, 1):
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        with pytest.raises(RuntimeError, match="routed twice"):
            with context.router.routing({layer: (LORA, tagged(6))}):
                pass
        assert "forward" in vars(layer)
    with pytest.raises(ZeroDivisionError):
        with context.router.routing({layer: (ALL, tagged(1))}):
            1 / 0
    assert "forward" not in vars(layer) and not context.router.routes
