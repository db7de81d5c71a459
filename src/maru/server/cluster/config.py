"""The cluster tier's Mooncake settings: the JSON file SGLang's Mooncake backend reads, read
as SGLang reads it, so one file serves both (keys and defaults: docs/configuration.md). Unlike
SGLang, the tier has no standalone `client_server_address` mode.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
DEFAULT_SEGMENT = "4gb"  # SGLang's MOONCAKE_GLOBAL_SEGMENT_SIZE default
DEFAULT_TENANT = "default"


class ClusterConfigError(ValueError):
    """A cluster config file that cannot be used, with the reason (maru-server exits on it)."""


def parse_segment_size(value: Any) -> int:
    """SGLang's size forms: an int, a decimal string, or "<N>gb" (GiB); never negative."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            size = value
        elif isinstance(value, str) and value.strip().lower().endswith("gb"):
            size = int(value.strip()[:-2].strip()) * GIB
        else:  # (a bool too: "True" is no number)
            size = int(str(value).strip())
    except ValueError:
        raise ClusterConfigError(
            f"global_segment_size {value!r}: expected bytes (an int) or '<N>gb'"
        ) from None
    if size < 0:
        raise ClusterConfigError(f"global_segment_size {value!r} is negative")
    return size


@dataclass(frozen=True)
class MooncakeConfig:
    """What the tier passes to `MooncakeDistributedStore.setup`, and the tenant it tags keys
    with (keys of other tenants never meet)."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    protocol: str
    device_name: str
    master_server_address: str
    tenant_id: str = DEFAULT_TENANT

    @classmethod
    def from_file(cls, path: str | Path) -> MooncakeConfig:
        """Read `path` as SGLang does (`ClusterConfigError` with the reason when it cannot)."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ClusterConfigError(f"cannot read cluster config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ClusterConfigError(f"cluster config {path}: a JSON object expected")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "cluster config") -> MooncakeConfig:
        master = raw.get("master_server_address")
        if not isinstance(master, str) or not master.strip():
            why = (
                "a standalone client_server_address is not supported by the tier"
                if raw.get("client_server_address")
                else "master_server_address is required"
            )
            raise ClusterConfigError(f"{where}: {why}")
        tenant = str(raw.get("tenant_id", os.environ.get("MOONCAKE_TENANT_ID", ""))).strip()
        return cls(
            local_hostname=_local_hostname(raw),
            metadata_server=str(raw.get("metadata_server", "P2PHANDSHAKE")),
            global_segment_size=parse_segment_size(raw.get("global_segment_size", DEFAULT_SEGMENT)),
            protocol=str(raw.get("protocol", os.environ.get("MOONCAKE_PROTOCOL", "rdma"))),
            device_name=_device_name(raw.get("device_name", "")),
            master_server_address=master.strip(),
            tenant_id=tenant or DEFAULT_TENANT,
        )


def _local_hostname(raw: dict[str, Any]) -> str:
    """The environment first (one shared file, each node its own address), as SGLang."""
    for name in ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"):
        if os.environ.get(name):
            return os.environ[name]
    return str(raw.get("local_hostname") or "localhost")


def _device_name(value: Any) -> str:
    """A device, or SGLang's JSON map of tensor-parallel ranks to devices: rank 0's."""
    text = str(value or "")
    if not text.strip().startswith("{"):
        return text
    try:
        devices = json.loads(text)
    except ValueError:
        raise ClusterConfigError(f"device_name {text!r}: not valid JSON") from None
    return str(devices.get("0", devices.get(0, ""))) if isinstance(devices, dict) else ""
