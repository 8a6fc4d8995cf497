"""Jupyter Server's side: a gateway kernel manager that shows every session of the
gateway token's principal as a running kernel, the agents' included.

Jupyter Server's own ``GatewayMappingKernelManager`` lists only the kernels it started or
was asked to connect to. A person reviewing agents wants to see theirs in JupyterLab's
running-kernels panel and open one to watch it live, so this one adopts every kernel
the gateway lists (connecting to it, as ``POST /api/kernels {"kernel_id": ...}`` would),
then lists as usual. Use it with::

    jupyter server --GatewayClient.url=http://127.0.0.1:8765 \\
        --GatewayClient.auth_token=$KERNELHUB_TOKEN \\
        --ServerApp.kernel_manager_class=kernelhub.jupyter.server.KernelhubMappingKernelManager

Only imported by Jupyter Server (it needs jupyter_server installed); nothing else in
kernelhub imports it.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.gateway.gateway_client import gateway_request
from jupyter_server.gateway.managers import GatewayMappingKernelManager
from tornado.escape import json_decode


class KernelhubMappingKernelManager(GatewayMappingKernelManager):
    async def list_kernels(self, **kwargs: Any) -> list[dict[str, Any]]:
        response = await gateway_request(self.kernels_url, method="GET")
        for model in json_decode(response.body):
            if model["id"] not in self._kernels:
                await self.start_kernel(kernel_id=model["id"])  # type: ignore[no-untyped-call]
        return list(await super().list_kernels(**kwargs))  # type: ignore[no-untyped-call]
