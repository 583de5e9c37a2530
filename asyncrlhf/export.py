"""`asyncrlhf export RUN [--step N] --out DIR [--merge-lora] [--base REF]`: a trained policy as a
self-contained Hugging Face model directory, for transformers, vLLM (`vllm serve DIR`) or a hub.

RUN is a run directory (its newest checkpoint, or the one after N optimizer steps with `--step N`) or one
checkpoint directory (`<run>/checkpoints/step-XXXXXX`). DIR receives:

- the weights: full weights (a full fine-tuning run, or a LoRA run with `--merge-lora`: the adapter folded
  into the base weights), or the LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`) whose
  base is named portably: the hub id and the commit the run resolved it to, or the base directory's
  absolute path, never the machine-local cache copy the learner loaded (`--base` names it yourself);
- the tokenizer (its chat template included);
- `generation_config.json`: the EOS and pad ids the run used, and the run's sampling settings
  (`generator.sampling`) as the default way to sample;
- `training_config.yaml`: the resolved config the checkpoint was trained with.

A base that exists only on this machine (`tiny`, built in code; a GGUF de-quantized here) cannot be named
by an adapter: export it with `--merge-lora`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrlhf.config import Config, ModelConfig
from asyncrlhf.training import checkpoint

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ExportError(RuntimeError):
    """The export cannot be written as asked; the message says what to do."""


def find_checkpoint(run: Path, step: int | None) -> Path:
    """The checkpoint directory to export: `run` itself when it is one, else the run's newest or the one
    holding `step` optimizer steps."""
    if (run / checkpoint.STATE).is_file():
        if step is not None:
            raise ExportError(f"{run} is one checkpoint: give its run directory with --step, or leave --step "
                              "out")
        return run
    held = {checkpoint.read_state(d).steps: d for d in checkpoint.step_dirs(run)
            if (d / checkpoint.STATE).is_file()}
    if not held:
        raise ExportError(f"{run} holds no checkpoint: give a run directory (`runs/<name>`, with "
                          "checkpoints/) or a checkpoint directory (`runs/<name>/checkpoints/step-XXXXXX`)")
    if step is None:
        return held[max(held)]
    if step not in held:
        listed = ", ".join(f"{s} ({d.name})" for s, d in sorted(held.items()))
        raise ExportError(f"{run} has no checkpoint after {step} steps; it has: {listed}")
    return held[step]


def trained_config(path: Path) -> Config:
    """The config the checkpoint was trained with."""
    from asyncrlhf.config import load_config

    if not (path / checkpoint.CONFIG).is_file():
        raise ExportError(f"{path} has no {checkpoint.CONFIG}: the model it was trained from is unknown")
    return load_config([path / checkpoint.CONFIG])


def base_reference(model: ModelConfig) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) an exported adapter names: a hub id with its commit, or the
    absolute path of a local model directory."""
    from asyncrlhf.model_sources import PACKAGED_MODELS, TINY

    name = model.name_or_path
    if name == TINY or name in PACKAGED_MODELS or name.endswith(".gguf") or model.gguf_file:
        raise ExportError(f"the base model `{name}` exists only on this machine (built in code, or a GGUF "
                          "de-quantized here), so an adapter cannot name it: export with --merge-lora, or "
                          "name the base yourself with --base")
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve()), None
    return name, model.revision  # a hub id: the checkpoint's config holds the commit it resolved to


def generation_config(cfg: Config, tokenizer, model_config):
    """The EOS and pad ids the run sampled with, and its sampling settings as defaults."""
    from transformers import GenerationConfig

    configured = getattr(model_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    eos = sorted({tokenizer.eos_token_id, *configured} - {None})
    s = cfg.generator.sampling
    return GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=getattr(model_config, "bos_token_id", None), do_sample=True,
                            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None,
                            max_new_tokens=s.max_new_tokens)


def export(run: Path, out: Path, *, step: int | None = None, merge_lora: bool = False,
           base: str | None = None) -> Path:
    """Write the export into `out` (which must not exist, or be empty); returns the checkpoint exported."""
    from transformers import AutoTokenizer

    path = find_checkpoint(run, step)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: give a new directory with --out")
    cfg = trained_config(path)
    hf = checkpoint.hf_dir(path)
    adapter = (hf / "adapter_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(hf)  # as the learner saved it: pad token and chat template
    out.mkdir(parents=True, exist_ok=True)
    if adapter and not merge_lora:
        reference = (base, None) if base else base_reference(cfg.model)
        _write_adapter(hf, out, *reference)
        model_config = _base_config(cfg.model)
    else:
        model = _merged(path, cfg)
        model.save_pretrained(out, safe_serialization=True)
        model_config = model.config
    tokenizer.save_pretrained(out)
    generation_config(cfg, tokenizer, model_config).save_pretrained(out)
    shutil.copyfile(path / checkpoint.CONFIG, out / "training_config.yaml")
    return path


def _merged(path: Path, cfg: Config):
    """The checkpoint's policy as plain full weights (a LoRA adapter folded into its base)."""
    from asyncrlhf.models import is_lora

    model = checkpoint.load_checkpoint_policy(path, cfg.model)
    return model.merge_and_unload() if is_lora(model) else model  # type: ignore[operator]


def _write_adapter(hf: Path, out: Path, base: str, revision: str | None) -> None:
    for name in ADAPTER_FILES:
        shutil.copyfile(hf / name, out / name)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(base_model_name_or_path=base, revision=revision)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _base_config(model: ModelConfig):
    """The base model's config (its EOS and BOS ids), None where the base is not on this machine."""
    from transformers import AutoConfig

    from asyncrlhf.model_sources import ModelLoadError, resolve_model_dir

    try:
        directory = resolve_model_dir(model)
    except ModelLoadError:
        return None
    return AutoConfig.from_pretrained(directory) if directory is not None else None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory, or one checkpoint directory")
    parser.add_argument("--step", type=int, help="the checkpoint after this many optimizer steps "
                                                 "(default: the newest)")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    parser.add_argument("--merge-lora", action="store_true", help="fold a LoRA adapter into the base weights")
    parser.add_argument("--base", help="LoRA without --merge-lora: the base the adapter names (a hub id or "
                                       "a path), in place of the one the run trained from")
    args = parser.parse_args(argv)
    try:
        path = export(args.run, args.out, step=args.step, merge_lora=args.merge_lora, base=args.base)
    except ExportError as err:
        print(f"asyncrlhf export: {err}", file=sys.stderr)
        return 2
    state = checkpoint.read_state(path)
    print(f"asyncrlhf export: {path} (step {state.steps}, policy version {state.version}) -> {args.out}")
    return 0
