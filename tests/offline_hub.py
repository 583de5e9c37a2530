"""An offline Hugging Face hub for tests: a cache laid out as the hub's clients leave it after a first
download, holding tiny stand-ins under real ids. With `HF_HOME` pointing at it and `HF_HUB_OFFLINE=1`
(`environment`), transformers, huggingface_hub and datasets resolve those ids, at a branch or a pinned
commit, exactly as on a machine that downloaded them once and went offline.

    HF_HOME/hub/models--org--name/     blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
                                       refs/main (the commit)              huggingface_hub's layout
    HF_HOME/hub/datasets--org--name/   the same, holding the data set's parquet files
    HF_HOME/datasets/org___name/<config>/0.0.0/<commit>/
                                       the arrow files `datasets` prepared from them: what it reads offline
                                       (it looks for no hub file then, and takes the newest cached commit)

`Stand-ins` builds what a config names: a causal LM for a policy, a 1-output sequence classifier for a reward
or gold model, in the id's architecture family (GPT-NeoX for Pythia ids, DeBERTa-v2 with a tokenizer of its
own for DeBERTa ids, Llama otherwise), 2 layers of width 64 (head size 32, which vLLM's CPU kernels take)
with SmolLM2's tokenizer, read from the packaged GGUF; and rows of a hub data set from the fields the config
reads (a question with its `#### answer`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
WIDTH, LAYERS, HEADS, POSITIONS = 64, 2, 2, 2048


def environment(home: Path) -> dict[str, str]:
    """The variables that point every Hugging Face client at `home`, offline."""
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def repo_dir(home: Path, repo_id: str, kind: str = "model") -> Path:
    return home / "hub" / f"{kind}s--{repo_id.replace('/', '--')}"


def save_snapshot(home: Path, repo_id: str, save: Callable[[Path], None], *, kind: str = "model",
                  commit: str = COMMIT) -> Path:
    """Lay out what `save(dir)` writes as the hub cache holds repo `repo_id` at `commit` (the `main` branch):
    each file a content-addressed blob, the snapshot's entries links to them. Returns the snapshot."""
    repo = repo_dir(home, repo_id, kind)
    snapshot = repo / "snapshots" / commit
    with tempfile.TemporaryDirectory() as staging:
        save(Path(staging))
        for file in sorted(p for p in Path(staging).rglob("*") if p.is_file()):
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                shutil.copyfile(file, blob)
            link = snapshot / file.relative_to(staging)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def save_dataset(home: Path, repo_id: str, subset: str | None, splits: dict[str, list[dict]], *,
                 commit: str = COMMIT) -> None:
    """Data set `repo_id` (configuration `subset`) as a first `load_dataset` online leaves it: its parquet
    files in the hub cache, and the arrow files `datasets` prepared from them, under the commit."""
    from datasets import Dataset
    from datasets.packaged_modules.parquet.parquet import Parquet

    config = subset or "default"

    def write(root: Path) -> None:
        for split, rows in splits.items():
            (root / config).mkdir(parents=True, exist_ok=True)
            Dataset.from_list(rows).to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))

    snapshot = save_snapshot(home, repo_id, write, kind="dataset", commit=commit)
    files = {split: [str(snapshot / config / f"{split}-00000-of-00001.parquet")] for split in splits}
    name = repo_id.split("/")[-1]
    with tempfile.TemporaryDirectory() as staging:
        builder = Parquet(dataset_name=name, config_name=config, hash=commit, data_files=files,
                          cache_dir=staging)
        builder.download_and_prepare()
        # datasets names the cache directory after the repo (`org___name`) and the configuration when it
        # prepares a hub repo; this builder read local files, so its directory is renamed to match
        target = home / "datasets" / repo_id.replace("/", "___") / config / "0.0.0" / commit
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(builder.cache_dir, target)


def question_rows(fields: list[str], n: int = 8) -> list[dict]:
    """`n` rows holding a question with its worked answer (`... #### 7`) in each of `fields`."""
    return [{field: f"Tom has {i} apples and buys 2 more. How many apples?\n{i} + 2 = {i + 2}\n#### {i + 2}"
             for field in fields} for i in range(n)]


class StandIns:
    """Tiny models saved under the ids a config names (see the module's docstring)."""

    def __init__(self, home: Path):
        self.home = home
        self._tokenizer = None

    def tokenizer(self):
        """SmolLM2's tokenizer (a real BPE vocabulary and chat template), read once from the packaged GGUF."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from asyncrlhf.model_sources import PACKAGED_MODELS, _packaged_gguf

            gguf = _packaged_gguf(next(iter(PACKAGED_MODELS)))
            self._tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return self._tokenizer

    def save(self, repo_id: str, role: str) -> Path:
        """A stand-in for `repo_id` in the hub cache; `role` is `policy` (a causal LM) or `scorer`."""
        return save_snapshot(self.home, repo_id, lambda d: self.write(d, repo_id, role))

    def write(self, directory: Path, name: str, role: str) -> None:
        """A stand-in for model `name` saved as an HF directory."""
        import torch
        import transformers

        from asyncrlhf.models import build_tiny_tokenizer

        torch.manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))  # the same one each time
        lowered = name.lower()
        tokenizer = build_tiny_tokenizer() if "deberta" in lowered else self.tokenizer()
        specials = {"pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id,
                    "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        size = {"vocab_size": len(tokenizer), "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "intermediate_size": 2 * WIDTH, **specials}
        if "deberta" in lowered:
            config = transformers.DebertaV2Config(**size, max_position_embeddings=512, num_labels=1)
            model = transformers.DebertaV2ForSequenceClassification(config)
        else:
            family = "GPTNeoX" if "pythia" in lowered else "Llama"
            config = getattr(transformers, f"{family}Config")(**size, max_position_embeddings=POSITIONS,
                                                              num_labels=1, tie_word_embeddings=False)
            head = "ForCausalLM" if role == "policy" else "ForSequenceClassification"
            model = getattr(transformers, f"{family}{head}")(config)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)


HUB_CONFIGS = Path(__file__).parent / "data" / "hub_configs"


def save_hub_configs(home: Path) -> None:
    """The config.json alone of each real model in tests/data/hub_configs (`org--name.json`, as the hub serves
    it), as `huggingface-cli download ID config.json` leaves the cache: what `asyncrlhf plan` reads of a hub
    model. The recipes' plans run offline on them at the models' real sizes."""
    for file in sorted(HUB_CONFIGS.glob("*.json")):
        repo_id = file.stem.replace("--", "/", 1)
        save_snapshot(home, repo_id, lambda d, f=file: shutil.copyfile(f, d / "config.json"))
