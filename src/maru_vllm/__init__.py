"""vLLM integration: `MaruKVConnector`, a v1 KV connector that shares KV blocks through Maru
(`"kv_connector_module_path": "maru_vllm"` in `--kv-transfer-config`; docs/vllm.md)."""

from maru_vllm.connector import MaruConnectorMetadata, MaruKVConnector, MaruKVConnectorStats

__all__ = ["MaruConnectorMetadata", "MaruKVConnector", "MaruKVConnectorStats"]
