"""The training text: the Python standard library's own source, which every machine with Python has.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, in sorted order of their POSIX paths relative to that
root, except third-party packages (`site-packages`, `dist-packages`) and the test suites (any folder named `test`,
`tests` or `idle_test`: large, repetitive, and partly deliberately broken code). `HELD_OUT` is the evaluation text:
twelve small modules that exist unchanged in name from Python 3.10 to 3.13, never trained on. The library differs a
little between Python versions, so `CorpusInfo` records the version, the files and a hash of their contents.

The training files also leave out generated data (`is_data_table`, rule `DATA_TABLE_RULE`): files of at least
LITERAL_MIN_CHARS characters whose tokens are at least LITERAL_SHARE_MAX string or number literals. That is the
~70 charmap codec tables (`encodings/cp*.py`, `mac_*.py`, `iso8859_*.py`, `koi8_*.py`, ... and their alias table),
`pydoc_data/topics.py` (the library reference as one dict of strings, ~6% of the library), `html/entities.py`,
`stringprep.py` (Unicode tables) and `_sysconfigdata_*.py`; every hand-written module of the library scores under
0.4 (the highest, `keyword.py` 0.39, `locale.py` 0.32 with its alias table), so the cut is wide. The first run's
model spent its capacity on the codec tables and continued `def ` with their lines. The held-out files are not
filtered (none is a table); the rule and what it dropped go into train_info.json.
"""

from __future__ import annotations

import functools
import hashlib
import io
import platform
import random
import re
import sysconfig
import token
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_TOP = {"site-packages", "dist-packages"}
_SKIP_ANY = {"test", "tests", "idle_test"}

# The evaluation files (~250 KB, about 2% of the library): pure-Python modules of varied style (text processing,
# numbers, data structures, a parser) present in every supported Python version.
HELD_OUT = ("calendar.py", "fnmatch.py", "fractions.py", "graphlib.py", "heapq.py", "json/decoder.py", "numbers.py",
            "queue.py", "shlex.py", "statistics.py", "string.py", "textwrap.py")


LITERAL_SHARE_MAX = 0.4
LITERAL_MIN_CHARS = 4000  # smaller files (docstring-only packages' __init__.py) are kept whatever they hold
DATA_TABLE_RULE = (f"training files of >= {LITERAL_MIN_CHARS} characters whose Python tokens are >= "
                   f"{LITERAL_SHARE_MAX:.0%} string/number literals (STRING + NUMBER over STRING + NUMBER + NAME + "
                   "OP, by the tokenize module) are left out as generated data tables")


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


@functools.lru_cache(maxsize=None)  # one tokenize pass per text per process (a run splits the library twice)
def literal_share(text: str) -> float:
    """The share of string and number literals among a module's literal, name and operator tokens (a docstring
    counts as one token, so documented code scores low and a table of literals high). Text that stops tokenizing
    (a file of another Python version's syntax) is scored on the tokens before that point."""
    lit = other = 0
    try:
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            if t.type in (token.STRING, token.NUMBER):
                lit += 1
            elif t.type in (token.NAME, token.OP):
                other += 1
    except (tokenize.TokenError, SyntaxError):
        pass
    return lit / max(1, lit + other)


def is_data_table(text: str) -> bool:
    """Whether a file is generated data by `DATA_TABLE_RULE`."""
    return len(text) >= LITERAL_MIN_CHARS and literal_share(text) >= LITERAL_SHARE_MAX


def _check_held_out(paths: list[str], root: Path | None) -> None:
    missing = [p for p in HELD_OUT if p not in paths]
    if missing:
        raise FileNotFoundError(f"held-out files missing from the standard library at {root or stdlib_root()}: "
                                f"{missing}")


def held_out(root: Path | None = None) -> list[CorpusFile]:
    """The held-out files alone (what `split` returns second), without reading and classifying the training
    files: what an evaluation needs."""
    _check_held_out(stdlib_files(root), root)
    return read_files(list(HELD_OUT), root)


def split(root: Path | None = None, excluded: list[str] | None = None
          ) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files) of this Python's standard library; the training files without the data
    tables (`is_data_table`), whose paths are appended to `excluded` when given."""
    paths = stdlib_files(root)
    _check_held_out(paths, root)
    held = set(HELD_OUT)
    train = []
    for f in read_files([p for p in paths if p not in held], root):
        if is_data_table(f.text):
            if excluded is not None:
                excluded.append(f.path)
        else:
            train.append(f)
    return train, read_files(list(HELD_OUT), root)


def describe(files: list[CorpusFile], root: Path | None = None) -> CorpusInfo:
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.text.encode("utf-8") + b"\0")
    return CorpusInfo(python=platform.python_version(), root=str(root or stdlib_root()), files=len(files),
                      chars=sum(len(f.text) for f in files), sha256=h.hexdigest())


# a space that a word follows: where a prompt like "def " or "import " ends
_WORD_SPACE = re.compile(r"(?<= )(?=[A-Za-z_])")


def split_word_spaces(text: str, rate: float, rng: random.Random) -> list[str]:
    """`text` cut right after `rate` of its spaces that a word follows (each drawn from `rng`); the pieces join
    back to `text`. Why: byte-level BPE joins a space with the word after it (`" name"` is one token), so in the
    training stream a lone `" "` token never comes before a word, and a prompt that ends in a space ("def ",
    "import ") asks the model for a context it never saw: it answers with a comment or indentation. Encoding the
    pieces separately puts `" "` + `"name"` there instead, at the same text (a form of BPE-dropout limited to the
    one place prompts end)."""
    if rate <= 0:
        return [text]
    cuts = [m.start() for m in _WORD_SPACE.finditer(text) if rng.random() < rate]
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


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
