"""What a model directory *is*, as a digest that its serialisation does not change.

A study that runs across machines and sessions reuses a result only if the reward model it trained against is
the same model. The bytes of the files are not the model: a newer transformers writes another
`transformers_version` into config.json, a newer tokenizers lays tokenizer.json out differently, a newer
safetensors writes another header. So the digest covers what the model computes with:

- `*.safetensors`: each tensor's name, dtype, shape and raw bytes, in name order (the header's layout and
  `__metadata__` aside);
- `*.json`: the parsed document, keys sorted, without the writer's version stamp (`transformers_version`);
- any other file: its bytes; the training summary (`training.json`: timings) is not the model.

Two trainings that end in different weights differ here; the same weights written by two library versions do
not.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

NOT_THE_MODEL = ("training.json",)  # train-rm's summary: its timings differ run to run, the model does not
WRITER_STAMPS = ("transformers_version",)


def model_digest(path: Path) -> str:
    """sha256 over a model directory's (or one file's) contents as above; the first 16 hex digits."""
    digest = hashlib.sha256()
    files = ([p for p in sorted(path.rglob("*")) if p.is_file() and p.name not in NOT_THE_MODEL]
             if path.is_dir() else [path])
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        if file.suffix == ".safetensors":
            _tensors(file, digest)
        elif file.suffix == ".json":
            digest.update(_canonical_json(file))
        else:
            with file.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()[:16]


def _canonical_json(file: Path) -> bytes:
    try:
        data: Any = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"{file} is not valid JSON ({err}); "
                         "is this directory a model (train-rm's output)?") from err
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in WRITER_STAMPS}
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _tensors(file: Path, digest: Any) -> None:
    """Each tensor of a safetensors file (8-byte header length, JSON header, data), in name order."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SystemExit(f"{file} is not a safetensors file: it has no header")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SystemExit(f"{file} is not a safetensors file: its header is not JSON ({err})") from err
        start = 8 + size
        for name in sorted(k for k in header if k != "__metadata__"):
            entry = header[name]
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode() + b"\0")
            f.seek(start + begin)
            left = end - begin
            while left > 0:
                block = f.read(min(left, 1 << 22))
                if not block:
                    raise SystemExit(f"{file} is truncated: `{name}` ends past the end of the file")
                digest.update(block)
                left -= len(block)
