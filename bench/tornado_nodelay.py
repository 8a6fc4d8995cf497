"""Run a tornado application's module with TCP_NODELAY on every connection it serves.

    python bench/tornado_nodelay.py kernel_gateway --KernelGatewayApp.port=...

Tornado turns Nagle's algorithm back on after each HTTP response (``HTTP1Connection``
calls ``set_nodelay(False)``), and a WebSocket it upgrades keeps that, so a small frame
written after another waits for the client's delayed ACK (~40 ms on Linux). One socket
option fixes it; the suite measures Jupyter Kernel Gateway and Jupyter Server both as
shipped and with it, so that kernelhub is not compared with a configuration mistake.
"""

from __future__ import annotations

import runpy
import sys

from tornado import iostream

_set_nodelay = iostream.IOStream.set_nodelay


def _always(self: iostream.IOStream, value: bool) -> None:
    _set_nodelay(self, True)


def main() -> None:
    iostream.IOStream.set_nodelay = _always  # type: ignore[method-assign]
    _init = iostream.IOStream.__init__

    def init(self: iostream.IOStream, *args: object, **kwargs: object) -> None:
        _init(self, *args, **kwargs)  # type: ignore[arg-type]
        _set_nodelay(self, True)

    iostream.IOStream.__init__ = init  # type: ignore[method-assign]
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
