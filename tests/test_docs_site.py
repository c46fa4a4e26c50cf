"""The documentation site: it builds with ``mkdocs build --strict`` from this tree, offline, and fails on a broken link;
every page opens with its title and is in the navigation; the metric-name page names every key the code logs; the
commands the pages give agree with what the package defines and prints."""

from __future__ import annotations

import html
import importlib.util
import itertools
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.parent != DOCS / "results")
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason='mkdocs is not installed (pip install -e ".[docs]")'
)


def mkdocs_build(config, site, cwd=REPO) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` in a fresh process, this tree first on the path (mkdocstrings reads its source)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",
    }
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


#: A Sphinx role as the built HTML shows one that was not rewritten: ``:class:<code>~a.b.C</code>``.
RAW_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|mod|attr|obj|exc|const|type):(?:<code>|`)")


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    """Every page, link, anchor and generated reference page: a warning fails the build (``--strict``)."""
    proc = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = tmp_path / "site"
    reference = (built / "reference" / "trainer" / "index.html").read_text()
    generated = 'id="lightning_fl.federated.trainer.arguments.TrainerArguments.rounds"'  # from the code
    assert generated in reference
    assert "Communication rounds R." in reference  # the field's docstring
    fetched = re.compile(r"<(?:link|script)[^>]+(?:href|src)=\"https?://", re.I)
    assert not [p for p in built.rglob("*.html") if fetched.search(p.read_text())], "a page loads a remote resource"
    # the docstrings' Sphinx roles are links (tools/sphinx_roles.py), none is shown as written
    raw = {str(p.relative_to(built)): RAW_ROLE.findall(p.read_text()) for p in built.rglob("*.html")}
    assert not {page: roles for page, roles in raw.items() if roles}, "raw Sphinx roles in the built site"
    target = r"lightning_fl\.federated\.trainer\.loop\.FederatedTrainer"
    link = rf'<a class="autorefs autorefs-internal"[^>]*href="[^"]*#{target}"'
    assert re.search(rf"configured by \({link}[^>]*><code>FederatedTrainer</code></a>", reference)
    # signatures are formatted (by ruff, in the docs extra): one parameter a line, not all of them on one
    assert "Formatting signatures requires" not in proc.stderr
    signature = reference.split('<div class="doc-signature highlight"><pre>', 1)[1].split("</pre>", 1)[0]
    signature = html.unescape(re.sub(r"<[^>]+>", "", signature))
    assert signature.startswith("TrainerArguments(\n    rounds: int = 10,\n    client_fraction: "), signature[:300]


@needs_mkdocs
def test_the_site_build_fails_on_a_broken_link_or_anchor(tmp_path):
    """The repository's own settings (``INHERIT``) make a link to a missing page, or to a missing heading, fail."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a page](missing.md) and [a heading](#no-such-heading)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "INHERIT": str(REPO / "mkdocs.yml"),
                "docs_dir": str(docs),
                "nav": [{"Home": "index.md"}],
                "plugins": ["search"],
            }
        )
    )
    proc = mkdocs_build(config, tmp_path / "site", cwd=tmp_path)
    assert proc.returncode != 0
    assert "missing.md" in proc.stderr and "no-such-heading" in proc.stderr


def nav_pages(entries) -> set[str]:
    found: set[str] = set()
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found |= nav_pages(value) if isinstance(value, list) else {value}
    return found


def test_every_page_is_in_the_navigation_and_opens_with_its_title():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert pages == listed, (sorted(pages - listed), sorted(listed - pages))
    for page in PAGES:
        first = next(line for line in page.read_text().splitlines() if line.strip())
        assert first.startswith("# "), f"{page.relative_to(REPO)} opens with {first[:60]!r}, not its title"


# -------------------------------------------------------------------------------------------------- metric names
PREFIXES = ("val", "test", "train", "fed", "comm", "privacy", "time", "strategy", "generator", "samples", "unprotected")
LITERAL = re.compile(rf"""(?<!\w)["']((?:{"|".join(PREFIXES)})/[A-Za-z0-9_/]*[A-Za-z0-9_])["']""")
TEMPLATE = re.compile(rf"""f["']((?:{"|".join(PREFIXES)})/[A-Za-z0-9_/]*)\{{""")  # f"comm/msg_client_{direction}..."
STRATEGY_METRIC = re.compile(r"""["'](\w+)["']: float\(""")  # what a strategy's step returns, logged as strategy/<key>


def logged_keys() -> tuple[set[str], set[str]]:
    """Every metric name written out in the package's code, and the fixed beginnings of the templated ones."""
    literal, template = set(), set()
    for path in (REPO / "lightning_fl").rglob("*.py"):
        text = path.read_text()
        literal |= set(LITERAL.findall(text))
        template |= {t for t in TEMPLATE.findall(text) if not t.endswith("/")}
        if path.parent.name == "strategies":
            literal |= {f"strategy/{k}" for k in STRATEGY_METRIC.findall(text)}
    return literal, template


def test_the_metric_names_page_names_every_key_the_code_logs():
    page = (DOCS / "reference" / "metrics.md").read_text()
    named = set(re.findall(r"`([a-z]+/[^`\s]+)`", page))
    literal, template = logged_keys()
    assert len(literal) > 50, sorted(literal)  # the search finds the keys (an empty search would pass anything)
    missing = sorted(k for k in literal if k not in named)
    assert not missing, f"logged by the code, not on docs/reference/metrics.md: {missing}"
    unmatched = sorted(t for t in template if not any(n.startswith(t) for n in named))
    assert not unmatched, f"templated keys with no entry on docs/reference/metrics.md: {unmatched}"
    # and the page names no fed/comm/privacy/time key the code does not log (<...> is a template, * a family)
    strict = {n for n in named if n.split("/")[0] in ("fed", "comm", "privacy", "time") and not set("<*") & set(n)}
    invented = sorted(n for n in strict if n not in literal and not any(n.startswith(t) for t in template))
    assert not invented, f"on docs/reference/metrics.md but logged nowhere: {invented}"


# --------------------------------------------------------------------------------------- commands the pages give
def test_every_flwr_run_names_a_connection_the_docs_define():
    texts = {p: p.read_text() for p in [REPO / "README.md", *PAGES]}
    defined = {name for text in texts.values() for name in re.findall(r"^\[superlink\.([\w-]+)\]", text, re.M)}
    assert "local-deployment" in defined
    runs = {p.relative_to(REPO): re.findall(r"flwr run \. ([\w-]+)", text) for p, text in texts.items()}
    used = [(page, name) for page, names in runs.items() for name in names]
    assert used and [u for u in used if u[1] not in defined] == [], (defined, used)


def test_the_python_quickstart_is_the_same_in_readme_and_the_tutorial():
    def python_block(text: str, after: str) -> str:
        return text[text.index(after) :].split("```python\n", 1)[1].split("```", 1)[0]

    readme = python_block((REPO / "README.md").read_text(), "## The same in Python")
    tutorial = python_block((DOCS / "tutorials" / "quickstart.md").read_text(), "## The same in Python")
    assert readme == tutorial


def test_the_privacy_page_quotes_what_the_planner_prints(capsys):
    """docs/privacy.md: epsilon 34.3 under fixed sampling and 4.0 under Poisson, from the command it gives."""
    from lightning_fl.privacy.__main__ import main

    page = " ".join((DOCS / "privacy.md").read_text().split())
    fixed, poisson = re.search(r"z = 1: epsilon ([\d.]+) fixed, ([\d.]+) Poisson, RDP\)", page).groups()
    command = re.search(r"`python -m lightning_fl\.privacy ([^`]*--sampling fixed)`", page).group(1).split()
    printed = {}
    for name, argv in (("fixed", command), ("poisson", [a if a != "fixed" else "poisson" for a in command])):
        assert main(argv) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1.0000 |"))
        printed[name] = float(row.split("|")[2])
    assert (f"{printed['fixed']:.1f}", f"{printed['poisson']:.1f}") == (fixed, poisson)


# ------------------------------------------------------------------------------------ what the package carries
def test_the_package_carries_its_license_changelog_types_and_one_version():
    import lightning_fl

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = project["project"]["version"]
    assert lightning_fl.__version__ == version
    assert f"## [{version}] - " in (REPO / "CHANGELOG.md").read_text()
    license_text = (REPO / "LICENSE").read_text()
    assert project["project"]["license"] == {"text": "Apache-2.0"}
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert (REPO / "lightning_fl" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["lightning_fl"]


def test_readme_and_the_install_page_list_every_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = (REPO / "README.md").read_text()
    paragraph = readme[readme.index("Extras (") :].split("\n\n", 1)[0]
    assert set(re.findall(r"`([\w-]+)`\s\(", paragraph)) == extras
    install = (DOCS / "tutorials" / "quickstart.md").read_text()
    assert set(re.findall(r"^\| `([\w-]+)` \|", install, re.M)) == extras


def test_the_docs_extra_brings_what_the_reference_pages_need():
    """The signature formatter (without ruff or Black mkdocstrings prints each signature on one line) and griffe,
    which tools/sphinx_roles.py imports."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    docs = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    names = {re.match(r"[\w-]+", requirement)[0] for requirement in docs}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings-python", "griffelib", "ruff"} <= names, names


#: An absolute path of the machine a file was written on: a temporary folder, a home or a workspace.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:tmp|home|root|work|Users|mnt|scratch|var/folders|private/var)/[^\s`'\")]*")


def test_no_published_file_holds_an_absolute_path_of_the_machine_it_was_written_on():
    """What docs/ publishes (pages, result tables, JSON records) names paths relative to the repository or
    placeholders, never a folder of the machine that ran it (``/tmp/...``, ``/home/...``, ``/root/...``,
    ``/work/...``): a reader's machine has none of them."""
    found = []
    for path in sorted(p for p in DOCS.rglob("*") if p.is_file()):
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a figure
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {m}" for m in MACHINE_PATH.findall(line)]
    assert not found, "\n".join(found)


def test_every_table_has_a_header():
    """A Markdown table whose header row is empty renders as a blank bar above the rows."""
    empty = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, (line, rule) in enumerate(itertools.pairwise(lines), 1):
            if re.fullmatch(r"\|( *\|)+ *", line.strip()) and re.fullmatch(r"\|( *:?-+:? *\|)+", rule.strip()):
                empty.append(f"{page.relative_to(REPO)}:{number}")
    assert not empty, "\n".join(empty)


# ------------------------------------------------------------------------------- cross-references in docstrings
def sphinx_roles():
    """``tools/sphinx_roles.py``, the griffe extension mkdocs.yml gives mkdocstrings (griffe: the docs extra)."""
    pytest.importorskip("griffe")
    from conftest import tool_module

    return tool_module("sphinx_roles")


def test_a_role_becomes_a_reference_with_the_text_sphinx_shows():
    roles = sphinx_roles()
    names = {
        "a.b.C": ("internal", "a.b.C"),
        "a.b.C.fit": ("internal", "a.b.C.fit"),
        "C": ("internal", "a.b.C"),
        "torch.nn.Module": ("external", "torch.nn.Module"),
    }
    missing = []
    text = (
        "(:class:`~a.b.C`'s arguments) :class:`a.b.C`, :meth:`~a.b.C.fit`, :py:func:`C`, :class:`the class <a.b.C>`,"
        " :class:`~torch.nn.Module`, :attr:`~a.b.\n C.fit` and :data:`Typo`"
    )
    out = roles.rewrite(text, names.get, missing.append)
    ref = '<autoref identifier="{}" optional>{}</autoref>'
    assert out == (
        f"({ref.format('a.b.C', '<code>C</code>')}'s arguments) {ref.format('a.b.C', '<code>a.b.C</code>')}, "
        f"{ref.format('a.b.C.fit', '<code>fit()</code>')}, {ref.format('a.b.C', '<code>C()</code>')}, "
        f"{ref.format('a.b.C', 'the class')}, "
        '<span title="torch.nn.Module"><code>Module</code></span>, '
        f"{ref.format('a.b.C.fit', '<code>fit</code>')} and <code>Typo</code>"
    )
    assert len(missing) == 1 and "Typo" in missing[0]
    assert roles.rewrite("pip install --no-binary :all: x; ``:class:`` by itself", names.get) == (
        "pip install --no-binary :all: x; ``:class:`` by itself"
    )


SOURCE = {
    "pkg/__init__.py": '"""The package: :class:`~pkg.codecs.Codec`, :mod:`pkg.codecs`."""\n'
    "from pkg.codecs import Codec\n",
    "pkg/codecs.py": '''"""Codecs: :class:`Codec` and :class:`Int8`, :meth:`Codec.encode`, :func:`~torch.zeros`."""
import torch


class Codec:
    """Encodes: :meth:`encode`, then :meth:`.decode`; raises :class:`ValueError`."""

    def encode(self, x):
        """The payload :meth:`decode` reads."""

    def decode(self, payload):
        """The inverse of :meth:`encode`."""


class Int8(Codec):
    """Eight bits: the inherited :meth:`encode`, and the package's own :class:`pkg.Codec`."""
''',
    "pkg/other.py": '"""Uses :class:`~pkg.codecs.Codec` (:meth:`.decode`), not :class:`~pkg.codecs.Codek`."""\n',
}


def write_package(root):
    for name, text in SOURCE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_roles_resolve_in_the_docstrings_scope_and_a_name_found_nowhere_is_a_warning(tmp_path, caplog):
    """Sphinx's lookup: the object, its class (inherited members too), its module and the module's imports; a
    leading ``.`` also matches by suffix; an imported module outside the package is external."""
    import griffe

    roles = sphinx_roles()
    write_package(tmp_path)
    with caplog.at_level("WARNING"):
        pkg = griffe.load("pkg", search_paths=[tmp_path], extensions=griffe.load_extensions(roles.SphinxRoles))

    def refs(obj):
        return re.findall(r'identifier="([^"]+)" optional><code>([^<]+)</code>|title="([^"]+)"', obj.docstring.value)

    assert refs(pkg) == [("pkg.codecs.Codec", "Codec", ""), ("pkg.codecs", "pkg.codecs", "")]
    codecs = pkg["codecs"]
    assert refs(codecs) == [
        ("pkg.codecs.Codec", "Codec", ""),
        ("pkg.codecs.Int8", "Int8", ""),
        ("pkg.codecs.Codec.encode", "Codec.encode()", ""),
        ("", "", "torch.zeros"),
    ]
    assert refs(codecs["Codec"]) == [
        ("pkg.codecs.Codec.encode", "encode()", ""),
        ("pkg.codecs.Codec.decode", "decode()", ""),
        ("", "", "ValueError"),
    ]
    assert refs(codecs["Codec.encode"]) == [("pkg.codecs.Codec.decode", "decode()", "")]
    assert refs(codecs["Int8"]) == [("pkg.codecs.Codec.encode", "encode()", ""), ("pkg.codecs.Codec", "pkg.Codec", "")]
    assert refs(pkg["other"]) == [("pkg.codecs.Codec", "Codec", ""), ("pkg.codecs.Codec.decode", "decode()", "")]
    assert "<code>Codek</code>" in pkg["other"].docstring.value
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "pkg/other.py:1:" in warnings[0] and "pkg.codecs.Codek" in warnings[0], warnings


@needs_mkdocs
def test_a_role_that_resolves_nowhere_fails_the_strict_build(tmp_path):
    """mkdocs.yml's mkdocstrings settings on a small package: a role naming no object fails ``--strict``, naming it
    and its file; the others are links (where a page shows the object) or code."""
    write_package(tmp_path / "src")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# API\n\n::: pkg.codecs\n\n::: pkg.other\n")
    repo = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    (mkdocstrings,) = [p["mkdocstrings"] for p in repo["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    python = mkdocstrings["handlers"]["python"]
    assert python["options"]["extensions"] == ["tools/sphinx_roles.py:SphinxRoles"]
    python["options"]["extensions"] = [f"{REPO / 'tools' / 'sphinx_roles.py'}:SphinxRoles"]
    python["paths"] = [str(tmp_path / "src")]
    config = {
        "site_name": "t",
        "docs_dir": "docs",
        "strict": True,
        "theme": {"name": "mkdocs"},
        "nav": [{"API": "index.md"}],
        "plugins": [{"mkdocstrings": mkdocstrings}],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site", cwd=tmp_path)
    assert proc.returncode != 0
    assert "pkg/other.py:1:" in proc.stderr and "pkg.codecs.Codek resolves to no object" in proc.stderr, proc.stderr
    # the same without the typo: it builds, and the roles are links to the objects on the page
    (tmp_path / "src" / "pkg" / "other.py").write_text('"""Uses :class:`~pkg.codecs.Codec` (:meth:`.decode`)."""\n')
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "site" / "index.html").read_text()
    assert not RAW_ROLE.search(page)
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#pkg\.codecs\.Codec\.decode"', page)
