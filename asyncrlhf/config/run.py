"""Where and how a run runs: its name and directory, Redis, the prompt task, metrics, and how `asyncrlhf up`
launches the services on one machine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator, model_validator

from asyncrlhf.config.base import Section


class GrpcTlsConfig(Section):
    """TLS for gRPC (WeightSync). Server side (generators): `cert_file` + `key_file`; with `client_ca_file`
    only clients holding a certificate signed by that CA are served (mutual TLS). Client side (the learner):
    `ca_file` verifies the server; `client_cert_file` + `client_key_file` present a certificate for mTLS."""

    cert_file: str | None = Field(None, description="Server certificate (PEM) of the WeightSync server.")
    key_file: str | None = Field(None, description="Private key (PEM) of `cert_file`.")
    client_ca_file: str | None = Field(
        None, description="Server side: CA (PEM) that client certificates must chain to (mutual TLS)."
    )
    ca_file: str | None = Field(None, description="Client side: CA (PEM) that verifies the server.")
    client_cert_file: str | None = Field(None, description="Client side: certificate (PEM) for mutual TLS.")
    client_key_file: str | None = Field(None, description="Client side: private key (PEM) of it.")
    server_name: str | None = Field(
        None, description="Client side: the name to verify in the server certificate, if not its host."
    )

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file or self.key_file)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca_file)


class RunConfig(Section):
    """The run: its name and directory, seed, auth token, TLS, trackers."""

    name: str = Field("default", description="Run name; Redis keys are `asyncrlhf:<name>:<stream>`.")
    dir: str = Field(
        "runs/{name}", description="Run directory (checkpoints, logs, reports); `{name}` expands."
    )
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    token: str | None = Field(
        None, description="Shared auth token for gRPC metadata and mutating HTTP routes (or ASYNCRLHF_TOKEN)."
    )
    allow_insecure_bind: bool = Field(
        False, description="Let a service bind a non-loopback address without a token (not recommended)."
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers the learner and evaluator log to "
        "(`asyncrlhf.trackers`); none by default.")
    tracker_errors: Literal["fail", "warn"] = Field(
        "fail", description="A tracker that is not installed or cannot start: fail at start, or warn and go "
        "on.")
    grpc_tls: GrpcTlsConfig = GrpcTlsConfig()
    stop_timeout_s: float = Field(
        20.0, gt=0, le=25,
        description="After SIGTERM/SIGINT a service exits within this many seconds whatever it is doing "
        "(the learner writes its checkpoint within it when it can); `asyncrlhf up` stops within 30 s.",
    )

    @property
    def path(self) -> Path:
        return Path(self.dir.format(name=self.name))


class SentinelConfig(Section):
    """Redis high availability: the sentinels that monitor a primary and its replicas. Services ask them for
    the primary and ask again after a failover; the learner follows each critical write with
    `WAIT wait_replicas wait_timeout_ms`, so an acknowledged write is on a replica before it goes on
    (docs/guarantees.md, "Redis durability")."""

    addresses: list[str] = Field(
        default_factory=list,
        description="The sentinels as host:port, e.g. [sentinel-0:26379, sentinel-1:26379, sentinel-2:26379] "
        "(several: any one that answers is enough). Empty: no sentinels, `redis.url` is used.",
    )
    master: str = Field("mymaster", description="The name the sentinels monitor the primary under.")
    password: str | None = Field(None, description="The sentinels' own password (their requirepass), if any.")
    db: int = Field(0, ge=0, description="The database number on the primary.")
    wait_replicas: int = Field(
        1, ge=0, description="Replicas that must hold the learner's critical writes before it goes on "
        "(Redis WAIT); 0: do not wait.",
    )
    wait_timeout_ms: int = Field(
        1_000, ge=1, description="How long one WAIT may take; fewer replicas by then: a warning in the log.",
    )

    @field_validator("addresses")
    @classmethod
    def _host_port(cls, addresses: list[str]) -> list[str]:
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"sentinel address {address!r} is not host:port: write e.g. "
                    "redis.sentinel.addresses=[sentinel-0:26379,sentinel-1:26379]"
                )
        return addresses

    @property
    def enabled(self) -> bool:
        return bool(self.addresses)

    @property
    def hosts(self) -> list[tuple[str, int]]:
        """(host, port) of each sentinel."""
        return [(a.rpartition(":")[0].strip("[]"), int(a.rpartition(":")[2])) for a in self.addresses]


class RedisConfig(Section):
    """The Redis every stream lives in: a URL, sentinels, or (neither) one `asyncrlhf up` embeds."""

    url: str | None = Field(
        None,
        description="redis:// or rediss:// URL (password allowed). Unset (and no redis.sentinel): `asyncrlhf "
        "up` starts an embedded Redis.",
    )
    sentinel: SentinelConfig = SentinelConfig()
    password: str | None = Field(None, description="Password, if not in the URL.")
    tls_ca_certs: str | None = Field(None, description="CA bundle for rediss:// connections.")
    persist: bool = Field(True, description="Embedded Redis: append-only file in the run directory.")
    appendfsync: Literal["always", "everysec"] = Field(
        "everysec",
        description="Embedded Redis: fsync of the append-only file. `always`: a write is on disk before it "
        "is acknowledged (a Redis crash loses nothing; slower writes). `everysec`: a crash loses up to ~1 s "
        "of writes, which the learner re-creates from its own records (docs/guarantees.md).",
    )
    claim_idle_ms: int = Field(
        30_000, ge=100, description="Re-claim entries pending longer than this (XAUTOCLAIM)."
    )
    max_deliveries: int = Field(
        3, ge=1, description="An entry failing this many times goes to the dead-letter stream."
    )
    block_ms: int = Field(
        1_000, ge=1, description="How long a consumer blocks on XREADGROUP before re-checking."
    )
    stream_maxlen: int = Field(
        100_000, ge=100, description="Approximate cap on each stream's length (XADD MAXLEN ~)."
    )
    reconnect_max_s: float = Field(30.0, gt=0, description="Longest back-off between reconnection attempts.")

    @model_validator(mode="after")
    def _one_way_to_the_server(self) -> RedisConfig:
        if self.sentinel.enabled and self.url:
            raise ValueError(
                "set redis.url or redis.sentinel.addresses, not both: with sentinels the primary's address "
                "comes from them (unset the URL with redis.url=null)"
            )
        if self.sentinel.enabled and self.tls_ca_certs:
            raise ValueError("redis.tls_ca_certs (TLS to Redis) is not supported with redis.sentinel yet: "
                             "use redis.url=rediss://... or sentinels without TLS")
        return self

    @property
    def external(self) -> bool:
        """Whether the config names a server (a URL or sentinels); if not, `asyncrlhf up` embeds one."""
        return bool(self.url or self.sentinel.enabled)

    @property
    def where(self) -> str:
        """The server as a log line may show it (no password)."""
        if self.sentinel.enabled:
            return f"sentinels {','.join(self.sentinel.addresses)} (primary `{self.sentinel.master}`)"
        return url_without_password(self.url) if self.url else "(not set)"


class EnvConfig(Section):
    """Multi-turn episodes (docs/environments.md): each prompt is an episode of model turns and environment
    steps (`kind: none`, the default: single completions). `kind: tools`: the model calls `tools` (Python
    functions) and the tools of an `mcp` server, and its answer (the turn with no call) is scored by
    `verifier`; `kind: class`: your own environment class; `kind: verifiers`: a `verifiers` environment
    (`name`, `args`); `kind: openenv`: an OpenEnv server at `url`."""

    kind: Literal["none", "tools", "class", "verifiers", "openenv"] = Field(
        "none", description="`none` (single completions, no episodes), `tools`, `class` (your `path`), "
        "`verifiers` (`name`) or `openenv` (`url`).")
    path: str | None = Field(None, description="kind `class`: `file.py:ClassName`, an environment with "
                             "reset(prompt) -> observation and step(action) -> (observation, reward, done).")
    args: dict = Field(default_factory=dict, description="kind `class`: keyword arguments of the class; "
                       "`verifiers`: of the environment's load_environment; `openenv`: sent with each reset "
                       "(e.g. seed).")
    name: str | None = Field(None, description="kind `verifiers`: the environment's id for "
                             "verifiers.load_environment (its module, installed or on the Python path).")
    url: str | None = Field(None, description="kind `openenv`: the OpenEnv server's base URL (http://, "
                            "https://, ws:// or wss://), started by you; each episode is a session on its "
                            "/ws WebSocket.")
    action_field: str = Field("message", description="kind `openenv`: the field of the server's action that "
                              "carries the model's turn text.")
    observation_field: str | None = Field(None, description="kind `openenv`: the observation's field shown "
                                          "to the model; unset: its only string field, else the observation "
                                          "as JSON.")
    tools: list[str] = Field(default_factory=list, description="kind `tools`: Python functions as tools, "
                             "`file.py:function`, or shipped ones (`calculator`).")
    mcp: list[str] = Field(default_factory=list, description="kind `tools`: the command that starts an MCP "
                           "server over stdio (e.g. [python, server.py]); its tools join `tools`.")
    verifier: str | None = Field("math_answer", description="kind `tools`: scores the answer against the "
                                 "prompt's reference: a shipped rule (`math_answer`) or `file.py:function` "
                                 "(answer, reference) -> float; unset: reward 0.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most.")
    max_episode_tokens: int = Field(256, ge=1, description="Tokens after the prompt at most (the model's "
                                    "turns and the observations between them).")
    step_timeout_s: float = Field(10.0, gt=0, description="An environment's reset or step running longer "
                                  "ends its episode (recorded as a timeout).")

    @model_validator(mode="after")
    def _kind_needs(self):
        if self.kind == "class" and not self.path:
            raise ValueError("task.env.kind `class` needs task.env.path (`file.py:ClassName`)")
        if self.kind == "tools" and not (self.tools or self.mcp):
            raise ValueError("task.env.kind `tools` needs task.env.tools or task.env.mcp")
        if self.kind == "verifiers" and not self.name:
            raise ValueError("task.env.kind `verifiers` needs task.env.name (the environment's id, e.g. "
                             "asyncrlhf.envs.vf_arithmetic)")
        if self.kind == "openenv" and not (self.url and urlsplit(self.url).scheme in
                                           ("http", "https", "ws", "wss")):
            raise ValueError("task.env.kind `openenv` needs task.env.url, the server's http(s):// or "
                             f"ws(s):// base URL (got {self.url!r})")
        return self


class TaskConfig(Section):
    """The prompts: the shipped demo task, your JSONL, or a Hugging Face dataset (docs/bring-your-own.md)."""

    name: str = Field(
        "demo", description="A shipped task (`demo`, `varlen`, `arithmetic`, `calculator`), `jsonl`, or `hf` "
        "(HF datasets)."
    )
    train_path: str | None = Field(None, description="JSONL with a `prompt` field (task `jsonl`).")
    eval_path: str | None = Field(None, description="JSONL of held-out prompts (task `jsonl`).")
    prompt_field: str = Field(
        "prompt", description="The prompt: a string, or a chat `messages` list of {role, content}."
    )
    dataset: str | None = Field(
        None, description="Task `hf`: a hub name, a `save_to_disk` directory, or a .parquet/.json/.jsonl/"
        ".csv file (a list of files joined by commas).",
    )
    subset: str | None = Field(None, description="Task `hf`: the hub dataset's configuration (e.g. `main`).")
    split: str = Field("train", description="Task `hf`: the training split.")
    eval_split: str | None = Field(None, description="Task `hf`: the held-out split (unset: none).")
    reference_field: str | None = Field(
        None, description="Task `hf`: the reference answer (string or number) that verifiable rewards use."
    )
    reference_pattern: str | None = Field(
        None, description="Regex whose first group is the reference inside `reference_field` (e.g. GSM8k's "
        "`####\\s*(.+)$`); unset: the whole field.",
    )
    revision: str | None = Field(None, description="Task `hf` from the hub: the dataset commit to pin.")
    max_examples: int | None = Field(None, ge=1, description="Use only the first rows of each split.")
    too_long: Literal["truncate", "fail", "skip"] = Field(
        "truncate", description="A prompt longer than model.max_prompt_tokens: keep its last tokens, fail at "
        "start naming its row, or skip it (counted in the log).",
    )
    env: EnvConfig = Field(default_factory=EnvConfig)
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail", description="A row with a missing or wrong-typed field: fail at start naming it, or skip it "
        "(skipped rows are counted in the log).",
    )


class MetricsConfig(Section):
    """Prometheus metrics on every service's `/metrics`."""

    enabled: bool = Field(True, description="Serve `/metrics` (health and readiness are always served).")


class LaunchConfig(Section):
    """How `asyncrlhf up` runs the services on one machine."""

    learner_procs: int = Field(1, ge=1, description="Learner processes (torchrun) on this machine.")
    evaluator: bool = Field(True, description="Run the evaluator service alongside.")
    restart: bool = Field(False, description="Restart a crashed service instead of stopping the run.")
    max_restarts: int = Field(
        5, ge=0, description="Restarts allowed per service within `restart_window_s` before the run stops."
    )
    restart_window_s: float = Field(
        300.0, gt=0, description="The window of the restart cap: a rate, so a long run never exhausts it."
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, description="Delay before a restart; doubles with each crash in a row (restart_stable_s)."
    )
    restart_backoff_max_s: float = Field(30.0, ge=0, description="Longest delay before a restart.")
    restart_stable_s: float = Field(
        10.0, ge=0, description="A service that ran this long before it died is not crash-looping: its "
        "back-off starts again from restart_backoff_s."
    )
    gpus: dict[str, str] = Field(
        default_factory=dict,
        description="CUDA_VISIBLE_DEVICES per service, e.g. {generator: '0', learner: '1,2,3'}.",
    )
    check_plan: bool = Field(
        True, description="On a GPU machine, `up` first plans the run on this machine's GPUs (`asyncrlhf "
        "plan`: each service's device and memory) and refuses, with the reason, a run that does not fit. "
        "false: start anyway (the plan's memory figures are estimates).")
    share_cores: bool = Field(
        True, description="On a CPU host, the HF generator(s) and the learner share the cores: a service "
        "computing alone uses all of them, n computing at once split them (asyncrlhf/cores.py). Off, or a "
        "service whose `threads` is set, or the vLLM backend (its threads are fixed at start): a fixed split."
    )
    fork_server: bool = Field(
        True, description="On a Linux CPU host, start the services by forking one process that imported "
        "torch, transformers and DeepSpeed once, instead of each importing them (seconds of CPU per service, "
        "at every start and restart; asyncrlhf/forkserver.py). A service whose environment the libraries "
        "read differently, a learner of several ranks, and every service on a GPU host: a process of its "
        "own.")
    progress_every_s: float = Field(1.0, gt=0, description="Refresh period of the progress display.")
    stall_after_s: float = Field(
        300.0, gt=0, description="The learner has stalled when it goes this long without a step: the "
        "progress display, the learner's log and the alert AsyncrlhfLearnerStalled then name the hop that "
        "holds it up and the evidence (docs/stalls.md). 300 s is longer than anything a healthy run waits "
        "on: a step and a generation round at the shipped workloads' scale (tens of seconds), a vLLM "
        "generator's start (weights and CUDA graphs, 1-3 min) before the first groups, a push to a dead "
        "generator (learner.push_timeout_s 60 s, then it leaves the registry); and short enough that a "
        "stall is named within 5 minutes, where the step-count alert took 20."
    )
    evaluator_grace_s: float = Field(
        600.0, gt=0, description="After the learner ends, wait this long for the last evaluation."
    )


def url_without_password(url: str) -> str:
    """`url` with its password, if any, as `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}***@{parts.hostname}{port}"))
