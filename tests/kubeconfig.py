"""Kubeconfig files: how every test reaches an API server, the emulator included, as users do."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_kubeconfig(path: Path, server: str, *, token: str | None = None,
                     namespace: str = "default") -> Path:
    """A kubeconfig with one context: `server` (an http:// emulator needs no CA) and, if
    given, a bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": token} if token else {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                  "namespace": namespace}}],
    }))
    return path
