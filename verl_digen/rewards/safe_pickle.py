"""A restricted unpickler: plain data only.

The pickle reward protocol (flow_grpo / ddpo ``reward-server``, veRL-Omni's HTTP scorer) sends
``pickle.dumps(...)`` both ways. Unpickling runs whatever callables the payload names, so a
reward server's answer (or, on our server, a client's request) could run code. :func:`safe_loads`
accepts only what these protocols carry: ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``,
``str``, ``bytes``, ``bytearray``, ``int``, ``float``, ``complex``, ``bool`` and ``None``.
Any other global (a class, a function, ``numpy`` scalars and arrays included) raises
:class:`UnsafePickleError` naming it; persistent ids are refused too.

The standard library's documented way to restrict unpickling is to subclass
:class:`pickle.Unpickler` and override ``find_class`` (see the ``pickle`` docs, "Restricting
Globals"); no maintained package does it for plain data, so these few lines are ours.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["UnsafePickleError", "safe_loads", "safe_dumps"]

# Globals a plain-data pickle may need. Protocol 2+ encodes dict/list/tuple/str/numbers with
# opcodes (no global at all); older protocols and a few types go through these constructors.
_BUILTINS = ("set", "frozenset", "bytearray", "complex")
_ALLOWED_GLOBALS = {
    *((module, name) for module in ("builtins", "__builtin__") for name in _BUILTINS),  # __builtin__: protocols 0-2
    ("_codecs", "encode"),  # how protocol 2 spells a bytes object: _codecs.encode(str, "latin1")
}
_PROTOCOL = 4  # what we send: readable by every Python 3.4+


class UnsafePickleError(ValueError):
    """A pickle that is not plain data (it names a global outside the allowed set, or is corrupt)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to unpickle global '{module}.{name}': only plain data is accepted (dict, list, tuple, "
            "set, str, bytes, int, float, bool, None); have the other side send plain lists of numbers "
            "(e.g. numpy's .tolist())"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing to unpickle persistent id {pid!r}: only plain data is accepted")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads(data)`` restricted to plain data; :class:`UnsafePickleError` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"safe_loads expects bytes, got {type(data).__name__}")
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, AttributeError from BUILD, ...
        raise UnsafePickleError(f"not a valid pickle of plain data: {type(exc).__name__}: {exc}") from None


def safe_dumps(value: Any) -> bytes:
    """``pickle.dumps(value)`` with the protocol both ends read (4)."""
    return pickle.dumps(value, protocol=_PROTOCOL)
