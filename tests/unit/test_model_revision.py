"""A hub model name pinned to a revision resolves (through the real huggingface_hub client, offline, from a
cache laid out as the hub writes it) to one commit's snapshot, which every load then reads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrlhf.models import load_policy, load_tokenizer
from tests.offline_hub import COMMIT, save_snapshot

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
from asyncrlhf.config import ModelConfig
from asyncrlhf.model_sources import resolved_revision
from asyncrlhf.models import load_policy
cfg = ModelConfig(name_or_path="acme/tiny-chat", allow_hub=True, revision={revision!r})
print(resolved_revision(cfg), sum(p.numel() for p in load_policy(cfg).parameters()))
"""


def hub_cache(tmp_path) -> Path:
    def write(directory):
        load_policy("tiny").save_pretrained(directory)
        load_tokenizer("tiny").save_pretrained(directory)

    save_snapshot(tmp_path, "acme/tiny-chat", write)
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


def test_the_test_cache_is_what_huggingface_hubs_own_scanner_reads(tmp_path):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache(tmp_path))
    assert info.warnings == []
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert (repo.repo_id, repo.repo_type, revision.commit_hash, set(revision.refs)) == (
        "acme/tiny-chat", "model", COMMIT, {"main"})
    assert any(f.file_name == "config.json" and f.blob_path.parent.name == "blobs" for f in revision.files)
