"""Secrets never reach the YAML that is printed, logged, and written into run directories and checkpoints."""

import pytest
import yaml

from asyncrlhf.config import load_config

pytestmark = pytest.mark.unit


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
