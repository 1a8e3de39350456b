"""Finds deltad._savedcore, the saved-tensor hooks' hot path in C.

`pip install ./client/python` builds it beside the package; a CMake build
puts it beside libdeltad_client.so (build/client/), and `cmake --install`
in the library folder with it, so it is looked for where the client
library is.
"""

import importlib.machinery
import importlib.util
import os
import sys

from deltad import _capi

_FILE = "_savedcore.abi3.so"


def _directories():
    """Where the extension may be besides the package, in the order
    tried: beside each place the client library may be."""
    out = []
    for path in _capi._candidates():
        if path == os.environ.get("DELTAD_CLIENT_LIBRARY"):
            path = os.path.abspath(path)  # may be relative
        if os.path.isabs(path):
            d = os.path.dirname(path)
            if d not in out:
                out.append(d)
    return out


def load_savedcore():
    try:
        from deltad import _savedcore  # beside the package
        return _savedcore
    except ImportError as e:
        errors = [f"beside the package: {e}"]
    for d in _directories():
        path = os.path.join(d, _FILE)
        if not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        loader = importlib.machinery.ExtensionFileLoader("deltad._savedcore",
                                                         path)
        spec = importlib.util.spec_from_file_location(
            "deltad._savedcore", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        try:
            loader.exec_module(module)
        except ImportError as e:
            errors.append(f"{path}: {e}")
            continue
        sys.modules["deltad._savedcore"] = module
        return module
    raise ImportError(
        "deltad.torch needs its extension deltad._savedcore (the saved-tensor "
        "hooks in C). `pip install ./client/python` builds it beside the "
        "package; a CMake build has it at build/client/" + _FILE + ", beside "
        "libdeltad_client.so, where it is found through "
        "DELTAD_CLIENT_LIBRARY. Tried: " + "; ".join(errors))
