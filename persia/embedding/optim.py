"""Embedding optimizers, applied by the PS (PERSIA's ``persia.embedding.optim``).

Unlike PERSIA, every argument is honoured: SGD momentum and weight decay, Adagrad and Adam weight
decay. Adagrad applies torch's update (accumulate g², then step); ``persia_order=True`` keeps PERSIA's
(``docs/optimizers.md``). Each optimizer is a thin handle on a validated, frozen config that travels to the PS.
"""

from __future__ import annotations

from persia_nats.common.optim_config import AdagradConfig, AdamConfig, SGDConfig


class Optimizer:
    config: SGDConfig | AdagradConfig | AdamConfig

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class SGD(Optimizer):
    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.config = SGDConfig(lr=lr, momentum=momentum, weight_decay=weight_decay)


class Adam(Optimizer):
    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 eps: float = 1e-8) -> None:
        self.config = AdamConfig(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps)


class Adagrad(Optimizer):
    def __init__(self, lr: float = 1e-2, initial_accumulator_value: float = 1e-2, weight_decay: float = 0.0,
                 g_square_momentum: float = 1.0, eps: float = 1e-10, vectorwise_shared: bool = False,
                 persia_order: bool = False) -> None:
        self.config = AdagradConfig(lr=lr, initial_accumulator_value=initial_accumulator_value,
                                    weight_decay=weight_decay, g_square_momentum=g_square_momentum, eps=eps,
                                    vectorwise_shared=vectorwise_shared, persia_order=persia_order)


__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]
