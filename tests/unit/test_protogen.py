"""The committed stubs in asyncrlhf/_proto are exactly what `make proto` generates from proto/."""

from __future__ import annotations

import pytest

from asyncrlhf import protogen

pytestmark = pytest.mark.unit


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    protogen.generate(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in protogen.OUT_DIR.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run `make proto`, commit asyncrlhf/_proto"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto` and commit asyncrlhf/_proto"


def test_generated_imports_are_package_relative():
    grpc_stub = (protogen.OUT_DIR / "weights_pb2_grpc.py").read_text()
    assert "from . import weights_pb2" in grpc_stub
    assert "from asyncrlhf.v1" not in grpc_stub
