"""A small typed Python client for sandhold's NATS API."""

from sandhold.client.client import Client, CommandResult, connect

__all__ = ["Client", "CommandResult", "connect"]
