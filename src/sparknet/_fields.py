"""The configuration dataclasses read field by field: help texts, types and command-line flags.

``sparknet train``'s flags, the Spark ML ``Params`` (:mod:`sparknet.spark.ml`) and the
experiments' options are all generated from the config dataclasses with these helpers, so
none of them restates a field: the docstring written under a field is its help text::

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, RunConfig, title="training")
    run = from_args(RunConfig, parser.parse_args())
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import types
import typing
from collections.abc import Sequence

__all__ = ["field_docs", "base_type", "add_dataclass_arguments", "from_args", "changed", "flag"]


def field_docs(cls) -> dict[str, str]:
    """The docstrings written under each field of a dataclass and of the classes it extends (its help texts).

    A field a subclass declares again keeps the subclass's text.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            node = _classes_of(inspect.getsourcefile(klass)).get(klass.__qualname__)
        except (OSError, TypeError):  # a built-in class, or its file gone
            continue
        body = node.body if node is not None else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _classes_of(path: str | None) -> dict[str, ast.ClassDef]:
    """The top-level classes of a source file by name, its text parsed once (``inspect.getsource`` parses the
    whole file again for each class it is asked for: most of the time the command line took to be built)."""
    if path is None:
        raise OSError("no source file")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def base_type(tp) -> tuple[typing.Any, bool]:
    """``(type, optional)`` of an annotation such as ``int | None`` (a union of several types reads as str)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


class OldName(argparse.Action):
    """A flag's old name: still taken, with a warning naming the one to use (``--sync-interval`` is ``--tau``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import logging

        new = flag(self.dest)
        logging.getLogger("sparknet").warning("%s is the old name of %s; use %s", option_string, new, new)
        setattr(namespace, self.dest, values)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with every flag's default after its help (``(default: 0.01)``), except where there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is argparse.SUPPRESS or default is False
                or action.option_strings == [] or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        if isinstance(default, (list, tuple)) and not default:
            return text
        return f"{text} (default: %(default)s)"


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, *, skip: Sequence[str] = (),
                            title: str | None = None) -> None:
    """Add one ``--flag`` per field of ``cls`` to ``parser`` (defaults taken from the dataclass).

    A bool field becomes ``--flag/--no-flag``, an enum field a choice of its values, a tuple
    field a list of ints; ``title`` names the group in ``--help`` (default: the class name).
    """
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        name = flag(f.name)
        tp, optional = base_type(hints[f.name])
        default = field_default(f)
        help_text = docs.get(f.name, "")
        # a field's metadata may name its values ({"choices": callable}, called here, as the lists live in
        # modules the configuration does not import; an enum field's: the members a flag may give)
        choices = list(f.metadata["choices"]()) if "choices" in f.metadata else None
        if tp is bool:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            group.add_argument(name, choices=choices or [m.value for m in tp],
                               default=default.value if isinstance(default, enum.Enum) else default, help=help_text)
        elif typing.get_origin(tp) is tuple:
            group.add_argument(name, type=int, nargs="*", default=default, help=help_text)
        else:
            group.add_argument(name, type=f.metadata.get("type", tp), default=default, choices=choices,
                               help=help_text + (" (optional)" if optional and default is None else ""))


def from_args(cls, args: argparse.Namespace):
    """An instance of the dataclass ``cls`` from the parsed flags of its fields (it checks itself)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def field_default(f: dataclasses.Field) -> typing.Any:
    """A dataclass field's default, made by its factory where it has one (``dataclasses.MISSING``: none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def changed(settings, names: Sequence[str] | None = None) -> dict[str, typing.Any]:
    """The fields of the dataclass instance ``settings`` (of ``names`` alone, where given) whose values differ from
    their defaults: the settings a user gave (a command line cannot tell ``--tau 50`` from no ``--tau``)."""
    out = {}
    for f in dataclasses.fields(settings):
        if names is not None and f.name not in names:
            continue
        default = field_default(f)
        value = getattr(settings, f.name)
        if default is dataclasses.MISSING or value != default:
            out[f.name] = value
    return out


def flag(name: str) -> str:
    """A field's command-line flag (``warmup_steps``: ``--warmup-steps``)."""
    return "--" + name.replace("_", "-")
