"""Pins every hardening choice of the container config (the Docker posture test checks
the same from inside a live container)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kernelhub.config import Limits
from kernelhub.image import CONNECTION_FILE, IPC_DIR, SANDBOX_UID
from kernelhub.kernel.connection import SessionDir
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker_config import container_config

MiB = 2**20


def config(tmp_path: Path, **limits: object) -> dict:
    spec = SandboxSpec(session_id="abc123def456", owner="alice", limits=Limits(**limits))
    sdir = SessionDir.create(
        tmp_path / spec.session_id, sandbox_uid=os.geteuid(), sandbox_gid=os.getegid(), labels={}
    )
    return container_config(
        spec,
        image="kernelhub/kernel:p1",
        runtime="runc",
        session_dir=sdir,
        instance="ci",
        seccomp_profile='{"defaultAction": "SCMP_ACT_ERRNO"}',
    ) | {"_key": sdir.key.get_secret_value()}


def test_no_network_no_privileges_read_only(tmp_path: Path) -> None:
    c = config(tmp_path)
    assert c["network_mode"] == "none"
    assert c["read_only"] is True
    assert c["cap_drop"] == ["ALL"]
    assert "cap_add" not in c and "privileged" not in c
    assert "no-new-privileges:true" in c["security_opt"]
    seccomp = [o for o in c["security_opt"] if o.startswith("seccomp=")]
    assert len(seccomp) == 1 and json.loads(seccomp[0].removeprefix("seccomp="))
    assert c["user"] == f"{SANDBOX_UID}:{SANDBOX_UID}"
    assert c["ipc_mode"] == "private"
    assert c["init"] is False  # our supervisor is PID 1


def test_limits_are_all_set_and_swap_is_not_extra(tmp_path: Path) -> None:
    c = config(tmp_path, memory_bytes=256 * MiB, cpus=0.5, pids=64, workspace_bytes=8 * MiB)
    assert c["mem_limit"] == c["memswap_limit"] == 256 * MiB
    assert c["nano_cpus"] == 500_000_000
    assert c["pids_limit"] == 64
    ws = c["tmpfs"]["/workspace"]
    assert f"size={8 * MiB}" in ws and "nosuid" in ws and "nodev" in ws
    assert f"uid={SANDBOX_UID}" in ws
    assert "size=" in c["tmpfs"]["/tmp"] and "nosuid" in c["tmpfs"]["/tmp"]
    assert any(u["Name"] == "core" and u["Hard"] == 0 for u in c["ulimits"])


def test_log_cannot_fill_the_disk(tmp_path: Path) -> None:
    log = config(tmp_path)["log_config"]
    assert log["Type"] in ("json-file", "local", "none")
    if log["Type"] != "none":
        assert log["Config"]["max-size"] and log["Config"]["max-file"] == "1"


def test_key_never_in_environment_or_command(tmp_path: Path) -> None:
    c = config(tmp_path)
    key = c.pop("_key")
    assert key not in json.dumps(c["environment"]) and key not in " ".join(c["command"])


def test_sockets_and_connection_file_are_mounts_not_ports(tmp_path: Path) -> None:
    c = config(tmp_path)
    mounts = {m["Target"]: m for m in c["mounts"]}
    assert mounts[CONNECTION_FILE]["ReadOnly"] is True
    assert mounts[IPC_DIR]["Type"] == "bind"
    assert "ports" not in c and "publish_all_ports" not in c


def test_labels_identify_session_owner_version_instance(tmp_path: Path) -> None:
    labels = config(tmp_path)["labels"]
    assert labels["org.kernelhub.managed"] == "true"
    assert labels["org.kernelhub.session"] == "abc123def456"
    assert labels["org.kernelhub.owner"] == "alice"
    assert labels["org.kernelhub.instance"] == "ci"
    assert labels["org.kernelhub.version"]


def test_without_a_host_state_dir_the_state_is_a_capped_tmpfs_of_its_own(tmp_path: Path) -> None:
    from kernelhub.sandbox.state import SANDBOX_PATH

    c = config(tmp_path, tmp_bytes=8 * MiB)
    opts = c["tmpfs"][SANDBOX_PATH].split(",")
    assert "size=8388608" in opts and {"noexec", "nosuid", "nodev"} <= set(opts)
    assert all(m["Target"] != SANDBOX_PATH for m in c["mounts"])
    with_dir = container_config(
        SandboxSpec(session_id="abc123def457"),
        image="i",
        runtime="runc",
        session_dir=SessionDir.create(
            tmp_path / "s2", sandbox_uid=os.geteuid(), sandbox_gid=os.getegid(), labels={}
        ),
        instance="ci",
        seccomp_profile="{}",
        state_dir=tmp_path / "s2.state",
        gateway="0123456789abcdef",
    )
    assert SANDBOX_PATH not in with_dir["tmpfs"]
    assert [m["Source"] for m in with_dir["mounts"] if m["Target"] == SANDBOX_PATH] == [
        str(tmp_path / "s2.state")
    ]
    assert with_dir["labels"]["org.kernelhub.gateway"] == "0123456789abcdef"


def test_egress_is_a_loopback_proxy_port_never_a_network_and_never_a_secret(
    tmp_path: Path,
) -> None:
    from pydantic import SecretStr

    from kernelhub.config import EgressPolicy, EgressSettings
    from kernelhub.sandbox.docker_config import egress_config

    assert egress_config(None) == ({}, [])
    assert egress_config(EgressSettings(enabled=False)) == ({}, [])
    ca = tmp_path / "ca.pem"
    settings = EgressSettings(
        port=3128,
        ca_cert_file=ca,
        ca_key_file=tmp_path / "ca.key",
        wheelhouse=tmp_path,
        policies={"p": EgressPolicy(headers={"a.example.com": {"K": SecretStr("s3cret")}})},
    )
    env, mounts = egress_config(settings)
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["KERNELHUB_EGRESS_PORT"] == "3128"
    assert "s3cret" not in repr(env) + repr(mounts)
    assert all(m["ReadOnly"] for m in mounts)
    assert {m["Source"] for m in mounts} == {str(ca), str(tmp_path)}  # never the CA key
    spec = SandboxSpec(session_id="abc123def456", owner="alice")
    sdir = SessionDir.create(
        tmp_path / "s", sandbox_uid=os.geteuid(), sandbox_gid=os.getegid(), labels={}
    )
    c = container_config(
        spec, image="i", runtime="runc", session_dir=sdir, instance="ci",
        seccomp_profile="{}", egress=settings,
    )  # fmt: skip
    assert c["network_mode"] == "none" and c["environment"]["HTTP_PROXY"].startswith("http://127.")
