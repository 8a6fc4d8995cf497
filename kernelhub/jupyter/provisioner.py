"""jupyter_client's seam to kernelhub: a kernel manager and a kernel provisioner that run
a kernel as a session on a kernelhub gateway, through :mod:`kernelhub.jupyter.bridge`.

- :class:`KernelhubKernelManager`: an ``AsyncKernelManager`` to hand to nbclient
  (``NotebookClient(nb, km=KernelhubKernelManager(gateway_url=..., token=...))``) or to use
  with jupyter_client directly. ``session_id=`` attaches to an existing session (an
  agent's, say: it shares its variables and history); without it a new session is
  created at start and deleted at shutdown.
- :class:`KernelhubProvisioner`: the same as a provisioner (entry point
  ``kernelhub-provisioner`` in ``jupyter_client.kernel_provisioners``), for a kernelspec
  that names it, so ``jupyter console --kernel kernelhub`` and ``nbclient
  --kernel_name kernelhub`` work too; ``python -m kernelhub.jupyter.provisioner install``
  writes that kernelspec.

Both read the gateway and the token from their traits, else from ``KERNELHUB_URL`` and
``KERNELHUB_TOKEN``, as the SDK does. Calling contract (jupyter_client's): the manager
calls ``pre_launch`` before starting the bridge process, ``cleanup(restart)`` after it
ended; only a cleanup that is not a restart deletes a session, and only one it created.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import httpx
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from traitlets import HasTraits, Unicode

from kernelhub.client._stream import http_error
from kernelhub.client.errors import GatewayUnreachableError, api_error
from kernelhub.jupyter.messages import kernel_id as kernel_id_of

BRIDGE_ARGV = [sys.executable, "-m", "kernelhub.jupyter.bridge", "-f", "{connection_file}"]
PROVISIONER_NAME = "kernelhub-provisioner"


class GatewayKernel:
    """The gateway's kernels API, as the manager and the provisioner use it."""

    def __init__(self, url: str, token: str) -> None:
        if not url or not token:
            raise ValueError(
                "a kernelhub kernel needs a gateway and a token: pass gateway_url= and token=, "
                "or set KERNELHUB_URL and KERNELHUB_TOKEN"
            )
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"token {token}"}

    async def _call(
        self, method: str, path: str, timeout: float, json: Any = None
    ) -> httpx.Response:
        # A kernel that cannot start surfaces in jupyter console or nbclient as this one
        # exception, so it says which gateway and which knob, not just a status code.
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                answer = await client.request(
                    method, f"{self.url}{path}", json=json, headers=self.headers
                )
        except httpx.TransportError as exc:
            raise GatewayUnreachableError(
                f"kernelhub gateway {self.url} did not answer {method} {path} ({exc!r}): "
                f"check the kernelspec's gateway_url or KERNELHUB_URL"
            ) from exc
        if answer.is_error and not (method == "DELETE" and answer.status_code == 404):
            err = http_error(answer.status_code, answer.headers, answer.content)
            raise api_error(
                err.status,
                err.error,
                f"kernelhub gateway {self.url} refused {method} {path}: {err.message} "
                "(the token is the provisioner's token, else KERNELHUB_TOKEN; a session to "
                "attach to is its session_id, else KERNELHUB_SESSION)",
                err.detail,
            )
        return answer

    async def create(self) -> str:
        answer = await self._call("POST", "/api/kernels", 120, {"name": "python3"})
        return str(answer.json()["id"])

    async def check(self, kernel_id: str) -> None:
        await self._call("GET", f"/api/kernels/{kernel_id}", 30)

    async def delete(self, kernel_id: str) -> None:
        await self._call("DELETE", f"/api/kernels/{kernel_id}", 60)


class _Target:
    """Which gateway kernel a manager or provisioner runs, and whether it made it."""

    def __init__(self) -> None:
        self.kernel_id: str | None = None
        self.owned = False

    async def ensure(self, gateway: GatewayKernel, session_id: str) -> str:
        if self.kernel_id is None:
            if session_id:
                self.kernel_id = kernel_id_of(session_id)
                await gateway.check(self.kernel_id)  # a clear 404 now, not a dead bridge later
            else:
                self.kernel_id = await gateway.create()
                self.owned = True
        return self.kernel_id

    async def release(self, gateway: GatewayKernel) -> None:
        if self.owned and self.kernel_id is not None:
            await gateway.delete(self.kernel_id)
        self.kernel_id, self.owned = None, False


def _bridge_env(url: str, token: str, kernel_id: str) -> dict[str, str]:
    return {"KERNELHUB_URL": url, "KERNELHUB_TOKEN": token, "KERNELHUB_KERNEL_ID": kernel_id}


class _GatewayOptions(HasTraits):
    """The options the kernel manager and the provisioner share."""

    gateway_url = Unicode("", config=True, help="the gateway, e.g. http://127.0.0.1:8765")
    token = Unicode("", config=True, help="a kernelhub token (default: KERNELHUB_TOKEN)")
    session_id = Unicode("", config=True, help="attach to this session instead of a new one")

    def gateway(self) -> tuple[GatewayKernel, str, str]:
        url = self.gateway_url or os.environ.get("KERNELHUB_URL", "")
        token = self.token or os.environ.get("KERNELHUB_TOKEN", "")
        return GatewayKernel(url, token), url, token


# KernelProvisionerMeta derives from MetaHasTraits, which mypy cannot see.
class KernelhubProvisioner(LocalProvisioner, _GatewayOptions):  # type: ignore[metaclass]
    """Launches the bridge for a gateway kernel (created here unless ``session_id``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._target = _Target()

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        gateway, url, token = self.gateway()
        session = self.session_id or os.environ.get("KERNELHUB_SESSION", "")
        kernel = await self._target.ensure(gateway, session)
        kwargs["env"] = {**kwargs.get("env", os.environ), **_bridge_env(url, token, kernel)}
        return dict(await super().pre_launch(**kwargs))

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if not restart:
            await self._target.release(self.gateway()[0])

    # A manager that persists its kernels (Enterprise Gateway, say) restores a provisioner
    # from this: without the gateway kernel, the restored one would make a second session
    # at its next launch and never delete the first.
    async def get_provisioner_info(self) -> dict[str, Any]:
        info = dict(await super().get_provisioner_info())
        info["kernelhub"] = {"kernel_id": self._target.kernel_id, "owned": self._target.owned}
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        saved = provisioner_info.get("kernelhub") or {}
        self._target.kernel_id = saved.get("kernel_id")
        self._target.owned = bool(saved.get("owned")) and self._target.kernel_id is not None

    @property
    def gateway_kernel_id(self) -> str | None:
        return self._target.kernel_id


class KernelhubKernelManager(AsyncKernelManager, _GatewayOptions):
    """An AsyncKernelManager whose kernel is a session on a kernelhub gateway."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kernel_spec = kernelspec()

    async def _async_pre_start_kernel(self, **kw: Any) -> Any:
        if self.provisioner is None:
            self.provisioner = KernelhubProvisioner(
                kernel_id=self.kernel_id or kw.get("kernel_id") or "",
                kernel_spec=self.kernel_spec,
                parent=self,
                gateway_url=self.gateway_url,
                token=self.token,
                session_id=self.session_id,
            )
        return await super()._async_pre_start_kernel(**kw)

    pre_start_kernel = _async_pre_start_kernel  # type: ignore[assignment]  # async, as in the base

    @property
    def gateway_kernel_id(self) -> str | None:
        p = self.provisioner
        return p.gateway_kernel_id if isinstance(p, KernelhubProvisioner) else None


def kernelspec(config: dict[str, str] | None = None) -> KernelSpec:
    metadata: dict[str, Any] = {"kernel_provisioner": {"provisioner_name": PROVISIONER_NAME}}
    if config:
        metadata["kernel_provisioner"]["config"] = config
    return KernelSpec(
        argv=BRIDGE_ARGV,
        display_name="Python 3 (kernelhub sandbox)",
        language="python",
        interrupt_mode="message",
        metadata=metadata,
    )


def install(name: str, config: dict[str, str], *, user: bool, prefix: str | None) -> str:
    """Write the kernelspec ``name`` (no token in it: the bridge reads KERNELHUB_TOKEN)."""
    spec = kernelspec(config).to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(spec, f, indent=1)
        return str(KernelSpecManager().install_kernel_spec(tmp, name, user=user, prefix=prefix))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelhub.jupyter.provisioner")
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="install a kernelspec that runs on a kernelhub gateway")
    inst.add_argument("--name", default="kernelhub")
    inst.add_argument("--url", default="", help="the gateway (default: KERNELHUB_URL at launch)")
    inst.add_argument("--session", default="", help="attach to this session (default: a new one)")
    inst.add_argument("--user", action="store_true")
    inst.add_argument("--prefix")
    args = parser.parse_args(argv)
    config = {k: v for k, v in (("gateway_url", args.url), ("session_id", args.session)) if v}
    print(install(args.name, config, user=args.user, prefix=args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
