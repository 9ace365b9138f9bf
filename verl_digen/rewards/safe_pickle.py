"""A restricted unpickler: plain data only.

The pickle reward protocol (flow_grpo / ddpo ``reward-server``, veRL-Omni's HTTP scorer) sends
``pickle.dumps(...)`` both ways. Unpickling runs whatever callables the payload names, so a
reward server's answer (or, on our server, a client's request) could run code. :func:`safe_loads`
accepts only what these protocols carry: ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``,
``str``, ``bytes``, ``bytearray``, ``int``, ``float``, ``complex``, ``bool`` and ``None``, and
numpy scalars and arrays of plain dtypes (bool, int, uint, float, complex, fixed-width str and
bytes: what scorer services answer, e.g. HPS's ``float32`` scores, and what clients send, e.g.
Flow-GRPO's UnifiedReward client's prompts as a ``str`` array): numpy's pickle constructors are
reached only through wrappers that build nothing but such values (an object, structured or
datetime dtype, or an ``ndarray`` subclass, is refused). Any other global (a class, a function) raises :class:`UnsafePickleError` naming it;
persistent ids are refused too.

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
# numpy dtype kinds accepted: bool, signed and unsigned int, float, complex, and fixed-width
# text (Flow-GRPO's UnifiedReward client sends its prompts as a numpy array of str)
_PLAIN_KINDS = "biufcUS"
# where numpy's pickles name their constructors (numpy 2 writes numpy._core, numpy 1 numpy.core)
_NUMPY_MODULES = ("numpy", "numpy._core.multiarray", "numpy.core.multiarray", "numpy._core.numeric", "numpy.core.numeric")


def _plain_dtype(dtype: Any) -> Any:
    import numpy as np

    dt = np.dtype(dtype)
    if dt.kind not in _PLAIN_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise UnsafePickleError(f"refusing numpy dtype {dt!r}: only bool, int, uint, float, complex and str/bytes "
                                "data is accepted")
    return dt


class _NdarrayToken:
    """What ``numpy.ndarray`` unpickles to: only a marker for :func:`_reconstruct` (the array
    class itself, called directly, would allocate any shape)."""


def _np_dtype(*args: Any) -> Any:
    import numpy as np

    return _plain_dtype(np.dtype(*args))


def _reconstruct(cls: Any, shape: Any, dtype: Any) -> Any:
    import numpy as np

    if cls is not _NdarrayToken:
        raise UnsafePickleError(f"refusing to reconstruct {cls!r}: only numpy.ndarray itself is accepted")
    # numpy's pickles build an empty array here and fill it from the payload's bytes (BUILD)
    return np.ndarray((0,), _plain_dtype(dtype))


def _scalar(dtype: Any, data: Any = None) -> Any:
    import numpy as np

    dt = _plain_dtype(dtype)
    if not isinstance(data, (bytes, bytearray)) or len(data) != dt.itemsize:
        raise UnsafePickleError(f"a numpy {dt} scalar needs {dt.itemsize} bytes of data")
    return np.frombuffer(bytes(data), dtype=dt)[0]


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: str = "C") -> Any:
    import numpy as np

    dt = _plain_dtype(dtype)
    if not isinstance(buffer, (bytes, bytearray)):
        raise UnsafePickleError("a numpy array's data must be bytes")
    return np.frombuffer(bytes(buffer), dtype=dt).reshape(shape, order=order).copy()


_NUMPY_GLOBALS = {"dtype": _np_dtype, "ndarray": _NdarrayToken, "_reconstruct": _reconstruct, "scalar": _scalar,
                  "_frombuffer": _frombuffer}


def _check_numpy(value: Any) -> None:
    """After loading: every array and scalar in ``value`` is of a plain dtype (BUILD may have
    given an array another one)."""
    import numpy as np

    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (np.ndarray, np.generic)):
            _plain_dtype(v.dtype)
            if isinstance(v, np.ndarray) and type(v) is not np.ndarray:
                raise UnsafePickleError(f"refusing {type(v).__name__}: only numpy.ndarray itself is accepted")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)


class UnsafePickleError(ValueError):
    """A pickle that is not plain data (it names a global outside the allowed set, or is corrupt)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module in _NUMPY_MODULES and name in _NUMPY_GLOBALS:
            return _NUMPY_GLOBALS[name]
        raise UnsafePickleError(
            f"refusing to unpickle global '{module}.{name}': only plain data is accepted (dict, list, tuple, "
            "set, str, bytes, int, float, bool, None, numpy numbers and plain arrays); have the other side "
            "send plain lists of numbers (e.g. numpy's .tolist())"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing to unpickle persistent id {pid!r}: only plain data is accepted")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads(data)`` restricted to plain data; :class:`UnsafePickleError` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"safe_loads expects bytes, got {type(data).__name__}")
    try:
        value = _RestrictedUnpickler(io.BytesIO(data)).load()
        _check_numpy(value)
        return value
    except UnsafePickleError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, AttributeError from BUILD, ...
        raise UnsafePickleError(f"not a valid pickle of plain data: {type(exc).__name__}: {exc}") from None


def safe_dumps(value: Any) -> bytes:
    """``pickle.dumps(value)`` with the protocol both ends read (4)."""
    return pickle.dumps(value, protocol=_PROTOCOL)
