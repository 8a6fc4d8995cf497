"""The provisioner's gateway calls fail as the SDK's errors, naming the gateway and knob."""

from __future__ import annotations

import socket

import pytest

from kernelhub.client.errors import GatewayUnreachableError
from kernelhub.jupyter.provisioner import GatewayKernel


async def test_an_unreachable_gateway_names_it_and_kernelhub_url() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(GatewayUnreachableError) as down:
        await GatewayKernel(url, "kh_token").create()
    assert url in str(down.value) and "KERNELHUB_URL" in str(down.value)


def test_a_kernel_needs_a_gateway_and_a_token() -> None:
    for url, token in (("", "kh_token"), ("http://127.0.0.1:1", "")):
        with pytest.raises(ValueError, match="KERNELHUB_URL and KERNELHUB_TOKEN"):
            GatewayKernel(url, token)
