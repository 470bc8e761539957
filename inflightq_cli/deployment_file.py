"""Where the running ``inflightq up`` is, for the CLI in another shell.

``up`` writes the Redis it settled on (a private one is on a random port) and its key prefix to
``deployment.json`` in inflightq's cache directory, and removes the file when it stops. ``inflightq
status``, ``purge`` and ``batch`` follow it when the environment names neither INFLIGHTQ_REDIS_URL
nor INFLIGHTQ_KEY_PREFIX (either one names a deployment, and then nothing is guessed).
A file whose ``up`` is no longer running is ignored. With two ``up`` at once, the later one's wins."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.model_source import cache_root
from shared.settings import Settings


@dataclass(frozen=True)
class Deployment:
    redis_url: str
    redis_cluster: bool
    key_prefix: str
    api_url: str
    pid: int  # the ``inflightq up`` process

    @property
    def running(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except PermissionError:  # alive, another user's
            return True
        except OSError:
            return False
        return True


def deployment_path() -> Path:
    return cache_root() / "deployment.json"


def write_deployment(deployment: Deployment) -> Path:
    """Writes the file readable by its owner only (a Redis URL may carry a password)."""
    path = deployment_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(f".{os.getpid()}.tmp")
    staged.touch(mode=0o600)
    staged.write_text(json.dumps(asdict(deployment), indent=2) + "\n")
    staged.replace(path)
    return path


def read_deployment() -> Deployment | None:
    """The running ``up``'s deployment; None when there is no file, it is unreadable, or its ``up`` has stopped."""
    try:
        deployment = Deployment(**json.loads(deployment_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return deployment if deployment.running else None


def remove_deployment(pid: int) -> None:
    """Removes the file if it is still the one ``up`` process ``pid`` wrote."""
    path = deployment_path()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def followed(settings: Settings) -> tuple[Settings, Deployment | None]:
    """``settings`` pointed at the running ``up``'s Redis and key prefix when they name neither
    themselves; the deployment followed, or None."""
    if {"redis_url", "key_prefix"} & settings.model_fields_set:
        return settings, None
    deployment = read_deployment()
    if deployment is None:
        return settings, None
    update = {
        "redis_url": deployment.redis_url,
        "redis_cluster": deployment.redis_cluster,
        "key_prefix": deployment.key_prefix,
    }
    return settings.model_copy(update=update), deployment
