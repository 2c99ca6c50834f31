"""The user's dense model for serving: ``--model path/to/model.py:DNN`` or ``--model package.module:make``.

The callable (a class or a function) is called with the JSON keyword arguments of
``--model-kwargs`` and must return a ``torch.nn.Module``; its weights then come from the
checkpoint's ``dense/model.pt``. A file path is imported under its own module name, with its
directory put first on ``sys.path`` so it can import its neighbours (as the example's training
script does).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from persia_nats.common.errors import ConfigError

__all__ = ["ModelFactory", "model_factory", "parse_model_kwargs"]

ModelFactory = Callable[[], torch.nn.Module]


def parse_model_kwargs(text: str | None) -> dict[str, Any]:
    """``--model-kwargs``: a JSON object (empty or None: no arguments)."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--model-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--model-kwargs must be a JSON object, got {type(kwargs).__name__}")
    return kwargs


def _import(module: str) -> Any:
    if module.endswith(".py") or "/" in module:
        path = Path(module).resolve()
        if not path.is_file():
            raise ConfigError(f"--model: no such file {module!r}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        name = f"persia_served_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"--model: cannot import {module!r}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # before exec: dataclasses and pickling look their module up there
        try:
            spec.loader.exec_module(mod)
        except ImportError as exc:
            sys.modules.pop(name, None)
            raise ConfigError(f"--model: {module!r} failed to import: {exc}") from None
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return mod
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"--model: cannot import {module!r}: {exc}") from None


def model_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> ModelFactory:
    """A factory building the model ``spec`` names (``module_or_file:callable``) with ``kwargs``.

    The factory is called once here, so a wrong name, wrong arguments or a callable that returns
    no ``torch.nn.Module`` fail at start (a :class:`ConfigError`), not at the first reload.
    """
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"--model must be MODULE_OR_FILE:CALLABLE, got {spec!r}")
    target = _import(module)
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise ConfigError(f"--model: {module!r} has no {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"--model: {spec!r} is not callable")
    kwargs = dict(kwargs or {})

    def make() -> torch.nn.Module:
        model = target(**kwargs)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"--model: {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    try:
        make()
    except TypeError as exc:
        raise ConfigError(f"--model: {spec}(**{kwargs!r}) failed: {exc}") from None
    return make
