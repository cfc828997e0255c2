"""start_shielded lives in core/_signals.py beside DeferredSigint; checkpoint/ still imports it from here."""
from ._signals import start_shielded

__all__ = ["start_shielded"]
