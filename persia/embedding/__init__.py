"""Embedding hyperparameters pushed to every PS (PERSIA's ``persia.embedding.EmbeddingConfig``)."""

from persia_nats.common.optim_config import EmbeddingHyperparams


def EmbeddingConfig(emb_initialization: tuple[float, float] = (-0.01, 0.01), admit_probability: float = 1.0,
                    weight_bound: float = 10) -> EmbeddingHyperparams:
    """Initialisation range (uniform, seeded by id), admission probability, and weight bound (<= 0: none)."""
    lower, upper = emb_initialization
    return EmbeddingHyperparams(init_lower=float(lower), init_upper=float(upper),
                                admit_probability=float(admit_probability), weight_bound=float(weight_bound))


def get_default_embedding_config() -> EmbeddingHyperparams:
    return EmbeddingConfig()


__all__ = ["EmbeddingConfig", "EmbeddingHyperparams", "get_default_embedding_config"]
