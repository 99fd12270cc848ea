"""`python -m launcher.data.token_file OUT [MAX_BYTES]`: the embedded corpus (the standard library's
sources) as a flat uint16 token file of byte ids, nanoGPT's format, for `train data=tokens
data.path=OUT data.dtype=uint16`: a file to try the format on before bringing your own."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from launcher.data.corpus import build_stdlib_tokens
from launcher.files import write_atomic

USAGE = "usage: python -m launcher.data.token_file OUT [MAX_BYTES]   (default 4000000 bytes)"


def write_token_file(out: Path, max_bytes: int) -> int:
    """Write `out`; return its token count."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "corpus.u8"
        build_stdlib_tokens(max_bytes, raw)
        tokens = np.fromfile(raw, dtype=np.uint8).astype(np.uint16)
    write_atomic(out, tokens.tobytes())
    return len(tokens)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or not (args[1:] or ["1"])[0].isdigit() or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    out = Path(args[0])
    count = write_token_file(out, int(args[1]) if args[1:] else 4_000_000)
    print(f"{out}: {count:,} tokens, uint16 byte ids (< 256, the default model.vocab_size)")


if __name__ == "__main__":
    main()
