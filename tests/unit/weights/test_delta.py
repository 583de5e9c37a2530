"""Delta encoding: what changed, by bits; applied to its base it gives the new tensor bit for bit; sizes."""

from __future__ import annotations

import pytest
import torch
import xxhash

from asyncrlhf.weights import delta

pytestmark = pytest.mark.unit


def test_only_changed_elements_are_kept_and_applying_gives_the_new_tensor():
    base = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.bfloat16)
    new = base.clone()
    new[0, 1], new[1, 2] = 2.5, -6.0
    d = delta.encode(base, new)
    assert d is not None
    assert d.indices.tolist() == [1, 5]  # flat: (0, 1) -> 1, (1, 2) -> 1 * 3 + 2
    assert d.values.tolist() == [2.5, -6.0] and d.values.dtype == torch.bfloat16
    assert d.nbytes == 2 * 4 + 2 * 2  # two int32 indices, two bf16 values
    out = delta.apply(base, d)
    assert torch.equal(out, new) and torch.equal(base[0], torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))


def test_bits_decide_so_the_checksum_of_the_result_is_the_new_tensors():
    base = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])  # -0.0 == 0.0 as values, not as bits
    d = delta.encode(base, new)
    assert d is not None and d.indices.tolist() == [0]
    out = delta.apply(base, d)
    assert xxhash.xxh3_64_intdigest(out.numpy().tobytes()) == xxhash.xxh3_64_intdigest(new.numpy().tobytes())


def test_a_delta_is_sent_only_when_smaller_than_the_tensor():
    base = torch.zeros(12, dtype=torch.bfloat16)  # 24 bytes whole
    three = base.clone()
    three[:3] = 1.0  # 3 * (4 + 2) = 18 bytes
    four = base.clone()
    four[:4] = 1.0  # 4 * 6 = 24 bytes: no gain
    assert delta.worth_sending(delta.encode(base, three), three)
    assert not delta.worth_sending(delta.encode(base, four), four)


def test_shape_or_dtype_changes_cannot_be_a_delta():
    assert delta.encode(torch.zeros(3), torch.zeros(4)) is None
    assert delta.encode(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)) is None
    assert not delta.worth_sending(None, torch.zeros(3))
