"""What the deploy files tell kernelhub, read against kernelhub's own Settings: every
``KERNELHUB_*`` variable they set must name a setting (a renamed or removed one fails
here, not in production), and the values together must load."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kernelhub.config import Settings, load_settings

PREFIX = "KERNELHUB_"


def _models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (``X``, ``X | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _is_mapping(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    return origin is dict or any(_is_mapping(a) for a in typing.get_args(annotation))


def setting(name: str) -> FieldInfo:
    """The Settings field ``KERNELHUB_A__B`` names, nested with ``__``; AssertionError
    naming the variable when there is none."""
    assert name.startswith(PREFIX), f"{name} is not a KERNELHUB_ variable"
    model: type[BaseModel] = Settings
    parts = name[len(PREFIX) :].lower().split("__")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        assert field is not None, (
            f"{name}: {model.__name__} has no field {part!r} "
            f"(it has {', '.join(sorted(model.model_fields))})"
        )
        last = depth == len(parts) - 1
        if last or _is_mapping(field.annotation):
            return field
        nested = _models(field.annotation)
        assert nested, f"{name}: {model.__name__}.{part} is not a nested model"
        model = nested[0]
    raise AssertionError(name)


def load_with(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as a process with exactly these ``KERNELHUB_*`` variables builds them."""
    import os

    for name in list(os.environ):
        if name.startswith(PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(PREFIX):
            setting(name)
            monkeypatch.setenv(name, value)
    return load_settings()


def check_command(command: str) -> None:
    """``kernelhub COMMAND`` exists (the manifests and units run it)."""
    from kernelhub.cli import build_parser

    [sub] = [a for a in build_parser()._actions if a.dest == "command"]
    commands = set(sub.choices or ())
    assert command in commands, f"there is no `kernelhub {command}`"
