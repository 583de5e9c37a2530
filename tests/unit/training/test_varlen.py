"""Varlen attention's own arithmetic (`asyncrlhf.training.varlen`): the window, softcap and sink terms on
hand-computed scores; a windowed model it cannot reach is refused packing."""

import math
from types import SimpleNamespace

import pytest
import torch

from asyncrlhf.training import varlen
from asyncrlhf.training.batch import build_batch
from asyncrlhf.training.forward import Packed, PackingError
from asyncrlhf.training.packing import pack
from tests.integration.learner.groups import scored_groups, train_groups

pytestmark = pytest.mark.unit


def test_a_window_of_two_lets_each_query_see_itself_and_the_key_before():
    assert varlen._allowed(4, 2, torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1]]


def test_softcap_and_sink_enter_the_softmax_as_the_eager_attention_computes_them():
    # one head, D = 1, scale 1: query 2 at position 1 against keys 1 (pos 0) and 3 (pos 1): scores 2 and 6;
    # softcap 4: 4 tanh(2/4) = 1.8485, 4 tanh(6/4) = 3.6209; a sink logit of ln 2 = 0.6931 joins the softmax:
    # p = e^1.8485, e^3.6209 over (e^1.8485 + e^3.6209 + 2) = 6.3504, 37.376 / 45.726 = 0.13888, 0.81739;
    # output = 0.13888 * 10 + 0.81739 * 20 = 17.736 (values 10 and 20)
    q = torch.tensor([[[[0.0], [2.0]]]])
    k = torch.tensor([[[[1.0], [3.0]]]])
    v = torch.tensor([[[[10.0], [20.0]]]])
    allowed = varlen._allowed(2, None, q.device)
    asks = varlen.Asks(softcap=4.0, sinks=torch.tensor([math.log(2.0)]))
    out = varlen._eager(q, k, v, allowed, 1.0, 0.0, asks)
    assert out[0, 0, 1, 0].item() == pytest.approx(17.736, abs=1e-3)


def test_a_windowed_model_outside_the_attention_interface_is_refused_packing():
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(sliding_window=4)  # windowed, and no transformers model to switch
    row = pack(build_batch(train_groups(scored_groups(2, 2, seed=1)), pad_id=0))
    with pytest.raises(PackingError, match="learner.packing=false"):
        Packed(1000, "varlen")._attention(model, row)
    assert not varlen.windowed(torch.nn.Linear(2, 2))
