"""Sphinx cross-reference roles in docstrings, rendered as links on the API reference pages (a griffe extension).

The package's docstrings cross-reference with Sphinx's roles (``:class:`~lightning_fl.federated.FederatedTrainer```,
``:meth:`fit```, ``:mod:`lightning_fl.privacy```), which mkdocstrings shows literally. mkdocs.yml loads this file as
an extension of mkdocstrings' Python handler; once griffe has read a package, every docstring's roles are rewritten
to what mkdocs-autorefs links, the way Sphinx resolves them:

- ``:class:`~a.b.C``` shows ``C``, ``:class:`a.b.C``` the whole path, ``:class:`title <a.b.C>``` the title; a
  function or method gets Sphinx's ``()`` (``:meth:`~a.b.C.fit``` shows ``fit()``);
- an unqualified or partly qualified name (``Codec``, ``Codec.encode``, ``fit``) is looked up in the docstring's
  scope: the object, its class (inherited members included), its module, with the module's imports;
  ``.name`` is also looked up by suffix among the package's objects (Sphinx's ``.`` prefix);
- a name of the package links to the page that documents it, or shows as code (its full path as tooltip) where no
  page does: the reference pages choose what they show;
- a name outside the package (``torch.nn.Module``, ``ValueError``) shows as code: the site builds offline, with no
  object inventories to link them to;
- a name found nowhere (a typo, a renamed object) is a warning naming the docstring's file and line, so
  ``mkdocs build --strict`` fails on it, and shows as code.

``rewrite`` is the text transformation alone (``resolve`` says what a name is); ``SphinxRoles`` the extension.
"""

from __future__ import annotations

import builtins
import html
import importlib.util
import re
from collections.abc import Callable, Iterator
from typing import Any

import griffe

#: ``:role:`target``` or ``:role:`title <target>```, with Sphinx's optional ``py:`` domain; a target may be broken
#: across a docstring's lines (the whitespace is dropped).
ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|func|data|mod|attr|obj|exc|const|type):`(?P<body>[^`]+)`")
#: Roles Sphinx renders with ``()`` after the name (its ``add_function_parentheses`` default).
CALLABLE = {"meth", "func"}

#: What a name is: ``("internal", canonical path)`` for an object of a loaded package, ``("external", path)`` for
#: one outside it (no page to link), ``None`` for a name that resolves nowhere.
Resolution = tuple[str, str] | None


def parse(role: str, body: str) -> tuple[str, str, bool]:
    """``(target, title, explicit)``: the target without ``~`` or ``!``, the text Sphinx shows, and whether the role
    gave that text (``title <target>``)."""
    body = " ".join(body.split())
    if (match := re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", body)) is not None:
        return "".join(match["target"].split()), match["title"], True
    target = "".join(body.split()).lstrip("!")
    short = target.startswith("~")
    target = target.lstrip("~")
    title = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
    if role in CALLABLE:
        title += "()"
    return target, title, False


def rewrite(text: str, resolve: Callable[[str], Resolution], warn: Callable[[str], None] | None = None) -> str:
    """``text`` with each Sphinx role replaced by an autorefs reference (``<autoref identifier=... optional>``: a
    link where a page documents the object, code where none does) or, for a name outside the package or found
    nowhere, by code; ``warn`` is told each name found nowhere."""

    def replace(match: re.Match) -> str:
        target, title, explicit = parse(match["role"], match["body"])
        shown = escape_html(title) if explicit else f"<code>{escape_html(title)}</code>"
        found = resolve(target)
        if found is None:
            if warn is not None:
                warn(f"{match[0]!r}: {target} resolves to no object")
            return shown
        kind, path = found
        if kind == "external":
            return f'<span title="{escape_html(path)}">{shown}</span>'
        return f'<autoref identifier="{escape_html(path)}" optional>{shown}</autoref>'

    return ROLE.sub(replace, text)


def escape_html(text: str) -> str:
    return html.escape(text, quote=True)


# ------------------------------------------------------------------------------------------ names in a package
def members(obj: griffe.Object | griffe.Alias) -> dict[str, Any]:
    """An object's members, a class's inherited ones included (an alias whose target is not loaded: none)."""
    try:
        return dict(obj.all_members) if obj.is_class else dict(obj.members)
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return {}


def follow(obj: griffe.Object | griffe.Alias, rest: list[str]) -> Resolution:
    """``obj``'s member ``rest[0]``'s member ``rest[1]`` ...; an import of something outside the loaded packages
    makes the whole name external."""
    for i, name in enumerate(rest):
        if obj.is_alias and not alias_resolves(obj):
            return "external", ".".join([obj.target_path, *rest[i:]])
        found = members(obj).get(name)
        if found is None:
            return None
        obj = found
    if obj.is_alias and not alias_resolves(obj):
        return "external", obj.target_path
    return "internal", obj.canonical_path


def alias_resolves(alias: griffe.Alias) -> bool:
    try:
        alias.final_target  # noqa: B018 (resolving it is the point)
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def scopes(obj: griffe.Object) -> Iterator[griffe.Object]:
    """The object, then each object around it up to its module's package (Sphinx: the class, then the module)."""
    while obj is not None:
        yield obj
        obj = obj.parent


def walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """Every object defined in ``obj`` (not the ones it imports), ``obj`` first."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)


class Resolver:
    """Resolves a role's target the way Sphinx's Python domain does, in a docstring's scope."""

    def __init__(self, collection: griffe.ModulesCollection, package: griffe.Module):
        self.collection = collection
        self.package = package
        self._paths: list[str] | None = None

    def __call__(self, scope: griffe.Object, target: str) -> Resolution:
        if target.startswith("."):
            return self.relative(scope, target.lstrip("."))
        first, *rest = target.split(".")
        if first in self.collection.members:  # a loaded package's full path
            return follow(self.collection.members[first], rest)
        for around in scopes(scope):
            if around.name == first and not around.is_module:
                return follow(around, rest)
            if first in (found := members(around)):
                return follow(found[first], rest)
        if hasattr(builtins, first) or importlib.util.find_spec(first) is not None:
            return "external", target
        return None

    def relative(self, scope: griffe.Object, target: str) -> Resolution:
        """``.name``: in scope as usual, else the one object of the package whose path ends with ``.name``."""
        if (found := self(scope, target)) is not None:
            return found
        if self._paths is None:
            self._paths = [obj.path for obj in walk(self.package)]
        matches = [path for path in self._paths if path.endswith(f".{target}")]
        return ("internal", matches[0]) if len(matches) == 1 else None


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring of a package once griffe has loaded it (``on_package``)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        resolve = Resolver(loader.modules_collection, pkg)
        for obj in walk(pkg):
            if obj.docstring is None or ":" not in obj.docstring.value:
                continue

            def warn(message: str, obj: griffe.Object = obj) -> None:
                line = obj.docstring.lineno or obj.lineno or 0
                griffe.logger.warning(f"{obj.relative_filepath}:{line}: {message} (in the docstring of {obj.path})")

            obj.docstring.value = rewrite(obj.docstring.value, lambda target, o=obj: resolve(o, target), warn)
