"""Building the KV connector an engine's ``kv_transfer_config`` names (``kv_connector`` holds the
interface and the local tier, ``kv_lmcache`` the LMCache client)."""

from __future__ import annotations

from v41plan.runtime.kv_connector import KV_CONNECTORS, ConnectorError, KVConnector, LocalConnector


def unit_planes(geometry) -> tuple[tuple[str, int], ...]:
    """``(name, bytes)`` of each plane of a PAGE unit in its byte stream's order: the main PAGE,
    then every index plane (``Pools.kv_transfer_tensors`` gives the matching pool views)."""
    index = sorted((p for p in geometry.planes if p.kind != "main"), key=lambda p: p.offset)
    return (("page", geometry.page_bytes),) + tuple((p.name, p.bytes_per_page) for p in index)


def build_connector(config: dict, geometry) -> KVConnector:
    """The connector ``kv_transfer_config`` names, for a pool of ``geometry``."""
    kind = config.get("kv_connector")
    args = (geometry.layout_id, geometry.page_unit_bytes, geometry.units_per_image)
    if kind == "local":
        return LocalConnector(
            *args, bytes=int(config.get("bytes", 1 << 30)), path=config.get("path")
        )
    if kind == "lmcache_mp":
        from v41plan.runtime.kv_lmcache import LMCacheConnector

        return LMCacheConnector(
            *args,
            host=config.get("host", "127.0.0.1"),
            port=int(config.get("port", 5555)),
            page_tokens=geometry.page_tokens,
            plane_bytes=tuple(n for _name, n in unit_planes(geometry)),
            timeout_s=float(config.get("timeout_s", 5.0)),
            staging_bytes=int(config.get("staging_bytes", 256 << 20)),
        )
    raise ConnectorError(f"kv_connector={kind!r}; accepted: {', '.join(KV_CONNECTORS)}")
