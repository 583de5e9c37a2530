import pytest
import yaml

from asyncrlhf.config_cli import main as config_main

pytestmark = pytest.mark.unit


def test_config_show_prints_override_and_fails_on_typo(capsys):
    assert config_main(["show", "configs/tiny.yaml", "learner.lr=2e-6"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["learner"]["lr"] == 2e-6
    assert config_main(["show", "configs/tiny.yaml", "learner.lrr=1"]) == 2
    assert "learner.lr" in capsys.readouterr().err
