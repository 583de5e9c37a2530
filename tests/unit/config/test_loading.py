"""Loading: defaults <- YAML files <- overrides in both spellings; a typo, a wrong type or a missing file
fails with the dotted key; every shipped config loads."""

from pathlib import Path

import pytest

from asyncrlhf.config import ConfigError, load_config, parse_overrides

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_yaml_then_overrides_in_both_spellings(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("learner:\n  lr: 1.0e-5\n  algorithm: rloo\nrun:\n  name: a\n")
    extra = tmp_path / "extra.yaml"
    extra.write_text("run:\n  name: b\n")
    cfg = load_config([base, extra], ["learner.lr=2e-6", "--learner.lora.enabled", "true", "--run.seed=7"])
    assert cfg.learner.lr == 2e-6  # override beats both files
    assert cfg.learner.algorithm == "rloo"  # from the first file, untouched by the second
    assert cfg.run.name == "b"  # later file wins
    assert cfg.learner.lora.enabled is True
    assert cfg.run.seed == 7


def test_override_values_parse_as_yaml_scalars():
    pairs = dict(parse_overrides(["a.b=1e-6", "a.c=true", "a.d=[q_proj, v_proj]", "a.e=null", "a.f=text"]))
    assert pairs == {"a.b": 1e-6, "a.c": True, "a.d": ["q_proj", "v_proj"], "a.e": None, "a.f": "text"}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("learner.lrr=1", "unknown key `learner.lrr`; did you mean `learner.lr`?"),
        ("lerner.lr=1", "unknown key `lerner`; did you mean `learner`?"),
        ("learner.kl.coeff=1", "did you mean `learner.kl.coef`?"),
        ("learner.lr=abc", "`learner.lr`"),
        ("learner.algorithm=sac", "`learner.algorithm`"),
        ("learner.max_staleness=-1", "`learner.max_staleness`"),
        ("learner.lr.x=1", "`learner.lr`"),
    ],
)
def test_bad_keys_and_types_name_the_dotted_path(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert fragment in str(err.value)


def test_dangling_flag_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="has no value"):
        load_config([], ["--learner.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([tmp_path / "nope.yaml"])
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config([bad])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    load_config([path])
