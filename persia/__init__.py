"""PERSIA's user API, served by this implementation.

Scripts written for PERSIA import the same names: ``persia.ctx``, ``persia.data``,
``persia.embedding.data``, ``persia.embedding.optim``, ``persia.env``.
"""

__version__ = "0.1.0"
