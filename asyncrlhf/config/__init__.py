"""One typed config tree for every service.

Load order: defaults <- YAML file(s) <- CLI overrides. Overrides are accepted in both spellings the seed
code's users type: `--learner.lr 1e-6` and `learner.lr=1e-6`. Values are parsed as YAML scalars, so
`1e-6`, `true`, `[q_proj, v_proj]` and `null` mean what they look like.

`learner` is a union on `learner.algorithm`: the shared knobs plus that algorithm's own section
(`learner.online_dpo`, `learner.policy_gradient`, `learner.ppo`). Scorers (`reward.scorers[]`,
`evaluator.gold`) are a union on `kind`: `rule`, `model`, `remote`, `judge`.

Unknown keys and wrong types fail with the full dotted path and, for a typo, a "did you mean" suggestion; a
knob of another algorithm or scorer kind, or a key that moved, names where it belongs. The resolved config
and its hash are what every service logs at start and what every checkpoint saves.

    base.py     Section, Tagged (a union on one field), ConfigError
    run.py      run, redis, task, metrics, launch
    model.py    model, sampling, generator
    reward.py   scorers, reward, evaluator
    judge.py    a language model as the judge (a scorer's and the evaluator's)
    learner.py  learner (one member per algorithm), kl, lora, deepspeed
    stages.py   sft, relabel, rm
    tree.py     Config: the whole tree, its YAML and hash
    keys.py     the key walker and error paths
    loading.py  load_config, parse_overrides
"""

from asyncrlhf.config.base import ConfigError, Section, Tagged
from asyncrlhf.config.judge import EvaluatorJudgeConfig, JudgeConfig, JudgeEndpointConfig, JudgeEngineConfig
from asyncrlhf.config.learner import (
    BestOfNLearnerConfig,
    DeepSpeedConfig,
    KLConfig,
    LearnerBase,
    LearnerConfig,
    LoraConfig,
    OnlineDPOConfig,
    OnlineDPOLearnerConfig,
    PolicyGradientConfig,
    PolicyGradientLearnerConfig,
    PPOConfig,
    PPOLearnerConfig,
)
from asyncrlhf.config.loading import load_config, parse_overrides
from asyncrlhf.config.model import (
    EngineHandoff,
    GeneratorConfig,
    ModelConfig,
    SamplingConfig,
    TinyModelConfig,
    VLLMConfig,
)
from asyncrlhf.config.reward import (
    EvaluatorConfig,
    JudgeScorerConfig,
    ModelScorerConfig,
    RemoteScorerConfig,
    RewardConfig,
    RuleScorerConfig,
    ScorerConfig,
)
from asyncrlhf.config.run import (
    EnvConfig,
    LaunchConfig,
    MetricsConfig,
    RedisConfig,
    RunConfig,
    SentinelConfig,
    TaskConfig,
)
from asyncrlhf.config.stages import RelabelConfig, RewardModelTrainingConfig, SFTConfig
from asyncrlhf.config.tree import Config

__all__ = [
    "BestOfNLearnerConfig",
    "Config",
    "ConfigError",
    "DeepSpeedConfig",
    "EngineHandoff",
    "EvaluatorConfig",
    "EvaluatorJudgeConfig",
    "GeneratorConfig",
    "JudgeConfig",
    "JudgeEndpointConfig",
    "JudgeEngineConfig",
    "JudgeScorerConfig",
    "KLConfig",
    "LaunchConfig",
    "LearnerBase",
    "LearnerConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "ModelScorerConfig",
    "OnlineDPOConfig",
    "OnlineDPOLearnerConfig",
    "PPOConfig",
    "PPOLearnerConfig",
    "PolicyGradientConfig",
    "PolicyGradientLearnerConfig",
    "RedisConfig",
    "RelabelConfig",
    "RemoteScorerConfig",
    "RewardConfig",
    "RewardModelTrainingConfig",
    "RuleScorerConfig",
    "RunConfig",
    "SFTConfig",
    "SamplingConfig",
    "ScorerConfig",
    "Section",
    "SentinelConfig",
    "EnvConfig",
    "TaskConfig",
    "Tagged",
    "TinyModelConfig",
    "VLLMConfig",
    "load_config",
    "parse_overrides",
]
