"""Proctor: a compliant runtime for code no person fully reviewed."""

from proctor.client import Client
from proctor.errors import ProctorError

__all__ = ["Client", "ProctorError", "__version__"]

__version__ = "0.1.0"
