"""The reward service: a consumer-group member on `rollouts` that scores every sample and writes `scored`
(loop.py), plus an HTTP scoring API, OpenRLHF-compatible `/get_reward` included (http.py)."""
