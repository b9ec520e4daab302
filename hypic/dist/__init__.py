"""Segment parallelism (DESIGN §6): engine processes that prefill a request's cold segments in
parallel and assemble it on one combine node, behind the EngineClient interface (hypic.engine.client).

    from hypic.dist import DistConfig, start_cluster
    client = start_cluster(EngineConfig(...), workers=4, gpus=None, device="auto", dist=DistConfig())
    await client.start()
"""
from __future__ import annotations

__all__ = ["DistConfig", "DistributedEngineClient", "start_cluster"]


def __getattr__(name: str):
    # The client pulls in torch and the engine; import it only when asked for.
    if name == "DistConfig":
        from hypic.dist.config import DistConfig
        return DistConfig
    if name == "DistributedEngineClient":
        from hypic.dist.client import DistributedEngineClient
        return DistributedEngineClient
    if name == "start_cluster":
        from hypic.dist.client import start_cluster
        return start_cluster
    raise AttributeError(f"module 'hypic.dist' has no attribute {name!r}")
