"""`python -m asyncrlhf.protogen` (`make proto`): regenerate the gRPC/protobuf stubs in `asyncrlhf/_proto/`.

The contracts live in `proto/asyncrlhf/v1/*.proto`. protoc writes `asyncrlhf/v1/<name>_pb2.py` with absolute
imports (`from asyncrlhf.v1 import weights_pb2`); we flatten them into one package and make those imports
package-relative, so the stubs work wherever `asyncrlhf` is installed. `tests/unit/test_protogen.py`
regenerates into a temporary directory and fails if the committed stubs differ.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE = "asyncrlhf/v1"
OUT_DIR = Path(__file__).resolve().parent / "_proto"

INIT = '''"""Generated gRPC/protobuf stubs for proto/asyncrlhf/v1 (`make proto`); do not edit."""
'''

_ABSOLUTE_IMPORT = re.compile(r"^from asyncrlhf\.v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc on every .proto of the package and write the fixed stubs into `out_dir`."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = [_write(out_dir / "__init__.py", INIT)]
        for generated in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1", generated.read_text())
            if generated.name.endswith("_grpc.py") and "class " not in text:
                continue  # a .proto without a service: protoc writes an empty module
            written.append(_write(out_dir / generated.name, text))
    return written


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args[0]) if args else OUT_DIR
    if out_dir == OUT_DIR and OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    for path in generate(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
