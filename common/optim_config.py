"""Embedding optimizer and hyperparameter configs, shared by the NN worker's user API and the PS.

The NN worker builds one of :class:`SGDConfig`, :class:`AdagradConfig` or :class:`AdamConfig` (PERSIA's
``persia.embedding.optim.SGD/Adagrad/Adam``) plus an :class:`EmbeddingHyperparams` (PERSIA's
``EmbeddingConfig``), and sends them to every PS replica as plain dicts (:func:`to_wire`,
:func:`hyperparams_to_wire`). The PS decodes them with :func:`optimizer_from_wire` and
:func:`hyperparams_from_wire`; because those read untrusted network input they raise nothing but
:class:`~persia_nats.common.errors.ConfigError`.

Unlike PERSIA, ``weight_decay`` is honoured by every optimizer, SGD honours ``momentum``, and Adagrad
adds g² before it steps (``persia_order`` keeps PERSIA's order).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from persia_nats.common.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

__all__ = [
    "AdagradConfig",
    "AdamConfig",
    "EmbeddingHyperparams",
    "OptimizerConfig",
    "SGDConfig",
    "hyperparams_from_wire",
    "hyperparams_to_wire",
    "optimizer_from_wire",
    "to_wire",
]


def _real(owner: str, name: str, value: Any) -> float:
    """Return ``value`` as a finite float, refusing bools, strings and non-finite numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        out = float(value)
    except OverflowError:
        raise ConfigError(f"{owner}.{name} is out of range: {value!r}") from None
    if not math.isfinite(out):
        raise ConfigError(f"{owner}.{name} must be finite, got {value!r}")
    return out


def _check(owner: str, name: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{name} must be {rule}, got {value!r}")


def _coerce_reals(obj: Any, names: tuple[str, ...]) -> None:
    """Replace each named field of a frozen dataclass with its validated float value."""
    owner = type(obj).__name__
    for name in names:
        object.__setattr__(obj, name, _real(owner, name, getattr(obj, name)))


@dataclass(frozen=True)
class SGDConfig:
    """Plain SGD, with torch.optim.SGD's momentum (dampening 0, no Nesterov) and L2 weight decay."""

    lr: float
    """Learning rate, > 0."""
    momentum: float = 0.0
    """Momentum factor in [0, 1); 0 keeps no optimizer state."""
    weight_decay: float = 0.0
    """L2 penalty >= 0, added to the gradient as ``weight_decay * w``."""

    def __post_init__(self) -> None:
        _coerce_reals(self, ("lr", "momentum", "weight_decay"))
        _check("SGDConfig", "lr", self.lr, self.lr > 0, "> 0")
        _check("SGDConfig", "momentum", self.momentum, 0 <= self.momentum < 1, "in [0, 1)")
        _check("SGDConfig", "weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")


@dataclass(frozen=True)
class AdagradConfig:
    """Adagrad as torch.optim.Adagrad and TorchRec apply it: accumulate g², then step.

    ``persia_order=True`` keeps PERSIA's order instead (step with the accumulator from before this
    gradient, then accumulate), for jobs that must reproduce a PERSIA model. ``docs/optimizers.md``
    gives both formulas.
    """

    lr: float = 1e-2
    """Learning rate, > 0."""
    initial_accumulator_value: float = 1e-2
    """Accumulator value of a freshly inserted row, >= 0."""
    weight_decay: float = 0.0
    """L2 penalty >= 0, added to the gradient as ``weight_decay * w``."""
    g_square_momentum: float = 1.0
    """Decay of the accumulator before g² is added, in [0, 1]; 1 is classic Adagrad."""
    eps: float = 1e-10
    """Added to the accumulator under the square root, > 0."""
    vectorwise_shared: bool = False
    """Keep one accumulator per row (fed with the row's mean g²) instead of one per element."""
    persia_order: bool = False
    """Step with the accumulator before adding g², under ``sqrt(acc + eps)``, as PERSIA did."""

    def __post_init__(self) -> None:
        _coerce_reals(self, ("lr", "initial_accumulator_value", "weight_decay", "g_square_momentum", "eps"))
        _check("AdagradConfig", "lr", self.lr, self.lr > 0, "> 0")
        iav = self.initial_accumulator_value
        _check("AdagradConfig", "initial_accumulator_value", iav, iav >= 0, ">= 0")
        _check("AdagradConfig", "weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")
        gsm = self.g_square_momentum
        _check("AdagradConfig", "g_square_momentum", gsm, 0 <= gsm <= 1, "in [0, 1]")
        _check("AdagradConfig", "eps", self.eps, self.eps > 0, "> 0")
        if not isinstance(self.vectorwise_shared, bool):
            raise ConfigError(f"AdagradConfig.vectorwise_shared must be a bool, got {self.vectorwise_shared!r}")
        if not isinstance(self.persia_order, bool):
            raise ConfigError(f"AdagradConfig.persia_order must be a bool, got {self.persia_order!r}")


@dataclass(frozen=True)
class AdamConfig:
    """Adam with per-row bias correction (each row counts its own steps) and L2 weight decay.

    A row updated at every step follows torch.optim.Adam (``amsgrad=False``, non-decoupled weight
    decay) exactly; PERSIA instead advanced one step count per feature group per PS.
    """

    lr: float = 1e-3
    """Learning rate, > 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moments, each in [0, 1)."""
    weight_decay: float = 0.0
    """L2 penalty >= 0, added to the gradient as ``weight_decay * w``."""
    eps: float = 1e-8
    """Added to ``sqrt(v_hat)``, > 0."""

    def __post_init__(self) -> None:
        _coerce_reals(self, ("lr", "weight_decay", "eps"))
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"AdamConfig.betas must be a pair of numbers, got {betas!r}")
        b1, b2 = _real("AdamConfig", "betas[0]", betas[0]), _real("AdamConfig", "betas[1]", betas[1])
        object.__setattr__(self, "betas", (b1, b2))
        _check("AdamConfig", "lr", self.lr, self.lr > 0, "> 0")
        _check("AdamConfig", "betas[0]", b1, 0 <= b1 < 1, "in [0, 1)")
        _check("AdamConfig", "betas[1]", b2, 0 <= b2 < 1, "in [0, 1)")
        _check("AdamConfig", "weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")
        _check("AdamConfig", "eps", self.eps, self.eps > 0, "> 0")


OptimizerConfig = SGDConfig | AdagradConfig | AdamConfig

_TYPE_OF: dict[type[OptimizerConfig], str] = {SGDConfig: "sgd", AdagradConfig: "adagrad", AdamConfig: "adam"}
_CLASS_OF: dict[str, type[OptimizerConfig]] = {name: cls for cls, name in _TYPE_OF.items()}


@dataclass(frozen=True)
class EmbeddingHyperparams:
    """How rows are born and bounded (PERSIA's ``EmbeddingConfig``)."""

    init_lower: float = -0.01
    """Lower end of the uniform initialisation; < ``init_upper``."""
    init_upper: float = 0.01
    """Upper end of the uniform initialisation."""
    admit_probability: float = 1.0
    """Chance in [0, 1] that an unseen id is stored at a training lookup."""
    weight_bound: float = 10.0
    """Every element is clipped to ``[-weight_bound, weight_bound]`` after an update; <= 0: no bound."""

    def __post_init__(self) -> None:
        _coerce_reals(self, ("init_lower", "init_upper", "admit_probability", "weight_bound"))
        lo, hi = self.init_lower, self.init_upper
        _check("EmbeddingHyperparams", "init_lower", lo, lo < hi, f"< init_upper ({hi!r})")
        p = self.admit_probability
        _check("EmbeddingHyperparams", "admit_probability", p, 0 <= p <= 1, "in [0, 1]")


def to_wire(cfg: OptimizerConfig) -> dict[str, Any]:
    """Encode an optimizer config as a msgpack-able dict with a ``"type"`` key.

    Args:
        cfg: The optimizer config.

    Returns:
        ``{"type": "sgd"|"adagrad"|"adam", <field>: <value>, ...}`` with ``betas`` as a 2-list.

    Raises:
        ConfigError: ``cfg`` is not one of the three optimizer configs.
    """
    name = _TYPE_OF.get(type(cfg))
    if name is None:
        raise ConfigError(f"not an embedding optimizer config: {type(cfg).__name__}")
    out: dict[str, Any] = {"type": name}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def _from_fields(cls: type[_D], d: dict[Any, Any], skip: tuple[str, ...] = ()) -> _D:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in names and k not in skip]
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown field(s) {sorted(map(repr, unknown))}")
    kwargs = {k: v for k, v in d.items() if k not in skip}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - untrusted input: anything else becomes a ConfigError
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def optimizer_from_wire(d: Any) -> OptimizerConfig:
    """Decode an optimizer config sent by :func:`to_wire` (untrusted input).

    Args:
        d: The decoded msgpack value.

    Returns:
        The optimizer config.

    Raises:
        ConfigError: ``d`` is not a dict, names an unknown type or field, lacks a required field, or
            holds a value of the wrong type or out of range. Nothing else is ever raised.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"optimizer config must be a map, got {type(d).__name__}")
    kind = d.get("type")
    cls = _CLASS_OF.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"optimizer type must be one of {sorted(_CLASS_OF)}, got {kind!r}")
    return _from_fields(cls, d, skip=("type",))


def hyperparams_to_wire(hyper: EmbeddingHyperparams) -> dict[str, Any]:
    """Encode embedding hyperparameters as a msgpack-able dict of their fields."""
    if not isinstance(hyper, EmbeddingHyperparams):
        raise ConfigError(f"not EmbeddingHyperparams: {type(hyper).__name__}")
    return dataclasses.asdict(hyper)


def hyperparams_from_wire(d: Any) -> EmbeddingHyperparams:
    """Decode embedding hyperparameters sent by :func:`hyperparams_to_wire` (untrusted input).

    Missing fields take their defaults.

    Raises:
        ConfigError: ``d`` is not a dict, or has an unknown field or a bad value. Nothing else is raised.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"embedding hyperparams must be a map, got {type(d).__name__}")
    return _from_fields(EmbeddingHyperparams, d)
