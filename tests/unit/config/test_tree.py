"""The whole tree: defaults validate, the hash is stable and leaves the token out, secrets never reach the
YAML that is printed, logged and written into run directories and checkpoints, and that YAML loads back to
the same config."""

from pathlib import Path

import pytest
import yaml

from asyncrlhf.config import Config, load_config

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
ALGORITHMS = ["online_dpo", "ppo", "rloo", "grpo", "dr_grpo", "reinforce_pp", "best_of_n"]


def test_defaults_validate_and_hash_is_stable():
    a, b = load_config(), Config()
    assert a == b
    assert a.hash() == b.hash() and len(a.hash()) == 12


def test_token_comes_from_env_and_never_enters_the_hash(monkeypatch):
    monkeypatch.setenv("ASYNCRLHF_TOKEN", "s3cret")
    with_token = load_config()
    assert with_token.run.token == "s3cret"
    monkeypatch.delenv("ASYNCRLHF_TOKEN")
    assert load_config().hash() == with_token.hash()


def test_to_yaml_leaves_out_the_token_and_redis_passwords():
    cfg = load_config([], ["run.token=tok-s3cret", "redis.password=pw-s3cret",
                           "redis.url=redis://user:url-s3cret@redis.example:6380/2"])
    text = cfg.to_yaml()
    assert "s3cret" not in text
    shown = yaml.safe_load(text)
    assert shown["run"]["token"] is None and shown["redis"]["password"] is None
    assert shown["redis"]["url"] == "redis://user:***@redis.example:6380/2"
    assert cfg.run.token == "tok-s3cret"  # the live config keeps them
    assert load_config([], ["redis.url=rediss://:pw@h/0"]).to_yaml().count("rediss://:***@h/0") == 1
    assert "redis://h:1/0" in load_config([], ["redis.url=redis://h:1/0"]).to_yaml()


def test_to_yaml_leaves_out_a_remote_scorers_token():
    cfg = load_config([], ["reward.scorers=[{kind: remote, url: 'http://rm:5000', token: rm-s3cret}]",
                           "evaluator.gold={kind: remote, url: 'http://gold:5000', token: gold-s3cret}"])
    assert "s3cret" not in cfg.to_yaml()
    assert cfg.reward.scorers[0].token == "rm-s3cret"  # the live config keeps it


@pytest.mark.parametrize(
    "files, overrides",
    [([path], []) for path in sorted(CONFIGS.glob("*.yaml"))]
    + [([CONFIGS / "tiny.yaml"], [f"learner.algorithm={algorithm}"]) for algorithm in ALGORITHMS],
    ids=lambda x: "-".join(str(getattr(v, "name", v)) for v in x),
)
def test_saved_yaml_loads_back_to_the_same_config(tmp_path, files, overrides):
    cfg = load_config(files, overrides)
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    again = load_config([saved])
    assert again == cfg and again.hash() == cfg.hash()
