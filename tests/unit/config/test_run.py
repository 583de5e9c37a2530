"""asyncrlhf/config/run.py: the `redis.sentinel` section (addresses checked, one way to name the server, its
password kept out of the saved config)."""

import pytest
import yaml

from asyncrlhf.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_sentinels_are_parsed_into_hosts_and_name_the_server():
    cfg = load_config([], ["redis.sentinel.addresses=[s0:26379,10.0.0.2:26380]", "redis.sentinel.master=rl"])
    assert cfg.redis.sentinel.hosts == [("s0", 26379), ("10.0.0.2", 26380)]
    assert cfg.redis.external and cfg.redis.sentinel.wait_replicas == 1
    assert cfg.redis.where == "sentinels s0:26379,10.0.0.2:26380 (primary `rl`)"
    assert not load_config([], []).redis.external  # neither a URL nor sentinels: `up` embeds a Redis


@pytest.mark.parametrize("address", ["sentinel-0", "sentinel-0:", ":26379", "s0:port", "s0:0", "s0:65536"])
def test_a_bad_sentinel_address_names_the_field_and_what_to_write(address):
    with pytest.raises(ConfigError) as err:
        load_config([], [f"redis.sentinel.addresses=['{address}']"])
    message = str(err.value)
    assert "`redis.sentinel.addresses`" in message and f"{address!r} is not host:port" in message
    assert "redis.sentinel.addresses=[sentinel-0:26379,sentinel-1:26379]" in message


def test_a_url_and_sentinels_together_fail_saying_how_to_unset_the_url():
    with pytest.raises(ConfigError, match=r"not both.*redis\.url=null"):
        load_config([], ["redis.url=redis://h:6379/0", "redis.sentinel.addresses=[s0:26379]"])
    cfg = load_config([], ["redis.url=null", "redis.sentinel.addresses=[s0:26379]"])
    assert cfg.redis.url is None and cfg.redis.external


def test_a_bad_wait_setting_fails_naming_it():
    with pytest.raises(ConfigError, match=r"`redis\.sentinel\.wait_timeout_ms`"):
        load_config([], ["redis.sentinel.wait_timeout_ms=0"])  # WAIT 0 would block the learner for ever
    with pytest.raises(ConfigError, match=r"`redis\.sentinel\.wait_replicas`"):
        load_config([], ["redis.sentinel.wait_replicas=-1"])


def test_the_section_error_does_not_echo_a_password():
    with pytest.raises(ConfigError) as err:
        load_config([], ["redis.password=pw-s3cret", "redis.url=redis://h:1/0",
                         "redis.sentinel.addresses=[s0:26379]"])
    assert "pw-s3cret" not in str(err.value)


def test_the_saved_config_leaves_out_the_sentinels_password():
    cfg = load_config([], ["redis.sentinel.addresses=[s0:26379]", "redis.sentinel.password=sp-s3cret"])
    shown = yaml.safe_load(cfg.to_yaml())
    assert shown["redis"]["sentinel"]["password"] is None and "sp-s3cret" not in cfg.to_yaml()
    assert shown["redis"]["sentinel"]["addresses"] == ["s0:26379"]
