"""A hub model name pinned to a revision resolves (through the real huggingface_hub client, offline, from a
cache laid out as the hub writes it) to one commit's snapshot, which every load then reads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrlhf.models import load_policy, load_tokenizer

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

PROBE = """
from asyncrlhf.config import ModelConfig
from asyncrlhf.model_sources import resolved_revision
from asyncrlhf.models import load_policy
cfg = ModelConfig(name_or_path="acme/tiny-chat", allow_hub=True, revision={revision!r})
print(resolved_revision(cfg), sum(p.numel() for p in load_policy(cfg).parameters()))
"""


def hub_cache(tmp_path) -> Path:
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / COMMIT
    load_policy("tiny").save_pretrained(snapshot)
    load_tokenizer("tiny").save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def probe(cache: Path, revision):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", PROBE.format(revision=revision)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_branch_and_a_pinned_commit_resolve_to_the_same_snapshot(tmp_path):
    cache = hub_cache(tmp_path)
    params = sum(p.numel() for p in load_policy("tiny").parameters())
    for revision in ("main", COMMIT, None):
        out = probe(cache, revision)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [COMMIT, str(params)]


def test_an_unknown_revision_fails_clearly(tmp_path):
    out = probe(hub_cache(tmp_path), "v9-does-not-exist")
    assert out.returncode != 0
    assert "hub model `acme/tiny-chat` at revision v9-does-not-exist cannot be fetched" in out.stderr
