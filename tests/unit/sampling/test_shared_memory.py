"""The shared-memory handoff from a generator to its engine's workers, both ends in this process (the vLLM
tests run them across processes): what the reader returns is bit for bit what was written, a version rewrites
the same segment (no file per version), and bytes that changed after the write are refused before any
tensor is returned."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.sampling.hops import shared_memory
from asyncrlhf.sampling.hops.shared_memory import Handoff, HandoffMismatch
from asyncrlhf.weights import shm
from asyncrlhf.weights.shm_read import SegmentMaps

pytestmark = pytest.mark.unit


def version(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 5, generator=gen), "norm.weight": torch.randn(5, generator=gen),
            "head.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
            "empty": torch.zeros(0)}


def test_versions_read_back_bit_for_bit_through_one_segment_rewritten_in_place(tmp_path):
    writer, maps = Handoff(tmp_path), SegmentMaps(tmp_path)
    names = set()
    for seed in (1, 2, 3):
        sent = version(seed)
        got = shared_memory.read(writer.write(sent), maps)
        assert list(got) == list(sent)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in sent.items())
        names.add(writer.segment.name)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert len(names) == 1  # the same file, rewritten: nothing created per version
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_larger_version_moves_to_a_larger_segment_and_removes_the_old_one(tmp_path):
    writer, maps = Handoff(tmp_path), SegmentMaps(tmp_path)
    shared_memory.read(writer.write(version(1)), maps)
    first = writer.segment.name
    big = {**version(2), "extra.weight": torch.randn(64, 64)}
    got = shared_memory.read(writer.write(big), maps)
    assert torch.equal(got["extra.weight"], big["extra.weight"])
    assert [p.name for p in tmp_path.iterdir()] == [writer.segment.name] != [first]
    writer.close()


def test_bytes_changed_after_the_write_are_refused_before_any_tensor_is_returned(tmp_path):
    writer, maps = Handoff(tmp_path), SegmentMaps(tmp_path)
    manifest = writer.write(version(1))
    _, _, _, offset, _, _ = manifest["tensors"][1]
    writer.segment.map[offset] ^= 0xFF  # the norm's first byte, after it was hashed
    with pytest.raises(HandoffMismatch, match="`norm.weight`.*nothing was loaded"):
        shared_memory.read(manifest, maps)
    writer.close()


def test_a_segment_that_is_gone_or_not_ours_is_refused(tmp_path):
    writer, maps = Handoff(tmp_path), SegmentMaps(tmp_path)
    manifest = writer.write(version(1))
    writer.close()
    with pytest.raises(HandoffMismatch, match="cannot open the handoff segment"):
        shared_memory.read(manifest, maps)
    with pytest.raises(HandoffMismatch, match="not a WeightSync segment name"):
        shared_memory.read({"segment": "../etc/passwd", "tensors": []}, maps)


def test_a_handoff_segment_is_held_while_its_generator_lives(tmp_path):
    """A learner's sweep of orphaned segments leaves a live generator's handoff alone."""
    writer = Handoff(tmp_path)
    writer.write(version(1))
    assert shm.sweep_stale(tmp_path) == []
    assert (tmp_path / writer.segment.name).exists()
    writer.close()
