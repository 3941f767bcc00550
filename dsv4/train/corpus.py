"""The training text: the Python standard library's own source, which every machine with Python has.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, in sorted order of their POSIX paths relative to that
root, except third-party packages (`site-packages`, `dist-packages`) and the test suites (any folder named `test`,
`tests` or `idle_test`: large, repetitive, and partly deliberately broken code). `HELD_OUT` is the evaluation text:
twelve small modules that exist unchanged in name from Python 3.10 to 3.13, never trained on. The library differs a
little between Python versions, so `CorpusInfo` records the version, the files and a hash of their contents.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_TOP = {"site-packages", "dist-packages"}
_SKIP_ANY = {"test", "tests", "idle_test"}

# The evaluation files (~250 KB, about 2% of the library): pure-Python modules of varied style (text processing,
# numbers, data structures, a parser) present in every supported Python version.
HELD_OUT = ("calendar.py", "fnmatch.py", "fractions.py", "graphlib.py", "heapq.py", "json/decoder.py", "numbers.py",
            "queue.py", "shlex.py", "statistics.py", "string.py", "textwrap.py")


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib root, POSIX separators
    text: str


@dataclass(frozen=True)
class CorpusInfo:
    """What a run was trained or evaluated on (written into the run's train_info.json and eval reports)."""

    python: str
    root: str
    files: int
    chars: int
    sha256: str  # over every file's path and bytes, in order: equal hashes = the same text

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the corpus files, sorted (the order every later step uses)."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if parts[0] in _SKIP_TOP or _SKIP_ANY.intersection(parts[:-1]) or not p.is_file():
            continue
        out.append(p.relative_to(root).as_posix())
    return sorted(out)


def read_files(paths: list[str], root: Path | None = None) -> list[CorpusFile]:
    """The files' text (UTF-8; the few undecodable bytes a library may hold become U+FFFD, deterministically)."""
    root = root or stdlib_root()
    return [CorpusFile(p, (root / p).read_bytes().decode("utf-8", errors="replace")) for p in paths]


def split(root: Path | None = None) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files) of this Python's standard library."""
    paths = stdlib_files(root)
    missing = [p for p in HELD_OUT if p not in paths]
    if missing:
        raise FileNotFoundError(f"held-out files missing from the standard library at {root or stdlib_root()}: "
                                f"{missing}")
    held = set(HELD_OUT)
    return read_files([p for p in paths if p not in held], root), read_files(list(HELD_OUT), root)


def describe(files: list[CorpusFile], root: Path | None = None) -> CorpusInfo:
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.text.encode("utf-8") + b"\0")
    return CorpusInfo(python=platform.python_version(), root=str(root or stdlib_root()), files=len(files),
                      chars=sum(len(f.text) for f in files), sha256=h.hexdigest())


def token_stream(encoded: list[list[int]], eos_id: int) -> torch.Tensor:
    """Files' token ids (no BOS) joined into one int64 stream, each file closed by EOS: the model learns where a
    module ends, and generation stops there."""
    return torch.tensor([t for ids in encoded for t in ids + [eos_id]], dtype=torch.int64)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, bos_id: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len] sequences: BOS, then seq_len - 1 stream tokens from uniformly drawn offsets (the engine
    always puts BOS first, so the model is trained with it there)."""
    starts = torch.randint(0, stream.numel() - seq_len + 2, (batch,), generator=gen)
    body = torch.stack([stream[s:s + seq_len - 1] for s in starts.tolist()])
    return torch.cat([torch.full((batch, 1), bos_id, dtype=torch.int64), body], dim=1)


def eval_windows(encoded: list[list[int]], eos_id: int, bos_id: int, seq_len: int) -> list[list[int]]:
    """Held-out text as scoring windows: each file (+ EOS) cut into consecutive pieces of seq_len - 1 tokens, each
    behind its own BOS. Every file token is predicted exactly once, from the context inside its window."""
    out = []
    for ids in encoded:
        ids = ids + [eos_id]
        out += [[bos_id] + ids[a:a + seq_len - 1] for a in range(0, len(ids), seq_len - 1)]
    return out
