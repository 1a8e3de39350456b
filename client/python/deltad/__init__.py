"""deltad: the node's GPU memory manager, from Python.

`deltad.Client` wraps the client library's C API (libdeltad_client.so,
through ctypes); `deltad.torch.managed` hands a PyTorch model's saved
activations to it. The library is found through $DELTAD_CLIENT_LIBRARY, then
next to this package, then the system's loader path.
"""

from deltad.client import Client, ClientStats, DeltadError, SessionStats

__all__ = ["Client", "ClientStats", "DeltadError", "SessionStats"]
