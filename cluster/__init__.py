"""The Ray wiring: Serve deployment around replica/, request router, app, client, HTTP, CLI."""

from cluster.app import app_builder, build_app
from cluster.client import Chunk, Client, Completion
from cluster.config import ClusterConfig
from cluster.transport import ReplicaError

__all__ = [
    "Chunk",
    "Client",
    "ClusterConfig",
    "Completion",
    "ReplicaError",
    "app_builder",
    "build_app",
]
