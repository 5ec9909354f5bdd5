"""vLLM beside the trainer: rollouts on ``vllm serve BASE --enable-lora``, the torch backend training a LoRA adapter.

The single-GPU path ART takes. The gateway forwards every call to vLLM under the policy's
adapter name (``backend.vllm.lora_name``); after each step the trainer writes the adapter it
just trained (peft's ``adapter_config.json`` and ``adapter_model.safetensors``) into
``backend.vllm.adapters_dir/v{version}`` and loads it into vLLM through vLLM's runtime LoRA
endpoint, ``POST /v1/load_lora_adapter`` (``load_inplace``: the same name, the new weights), so
the next step's rollouts sample from the policy being trained. A vLLM too old for
``load_inplace`` refuses the second load of a name; then the adapter is unloaded and loaded
again. Only the latest version's folder is kept (``v{N}`` folders of runs before go too).

vLLM must run with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (without it the endpoint does not
exist: a 404, said in one line naming the variable) and read ``adapters_dir`` at the same path.
The command line is in docs/vllm-lora.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import urllib.error
import urllib.request
from typing import Any

from agl_trainer.training import LocalServer

__all__ = ["VllmAdapters", "VllmLoraLink", "VllmPoliciesLink"]

logger = logging.getLogger("agl.trainer")
_VERSION = re.compile(r"v\d+")


class VllmAdapters:
    """vLLM's runtime LoRA endpoints at ``base_url`` (ending in ``/v1``), for the adapter named ``name``."""

    def __init__(self, base_url: str, name: str, *, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.loaded: str | None = None
        """The folder of the adapter vLLM serves under :attr:`name` now (loaded by this object)."""

    def _post(self, route: str, body: dict[str, Any]) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.base_url}/{route}", data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:  # noqa: S310 - the configured URL
                return int(reply.status), reply.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"vLLM at {self.base_url} could not be reached to load the adapter: "
                               f"{type(exc).__name__}: {exc}") from None

    def load(self, path: str) -> None:
        """Serve the adapter in ``path`` under :attr:`name` from now on; :class:`RuntimeError` naming why not."""
        status, text = self._post("load_lora_adapter", {"lora_name": self.name, "lora_path": path,
                                                        "load_inplace": True})
        if status == 400 and "already been loaded" in text:  # a vLLM without load_inplace: unload, then load
            self._post("unload_lora_adapter", {"lora_name": self.name})
            status, text = self._post("load_lora_adapter", {"lora_name": self.name, "lora_path": path})
        if status == 404:  # vLLM registers the route only with runtime LoRA updating on
            raise RuntimeError(f"vLLM at {self.base_url} has no /load_lora_adapter: start it with "
                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (docs/vllm-lora.md)")
        if status != 200:
            raise RuntimeError(f"vLLM at {self.base_url} refused the adapter {path} as {self.name!r} "
                               f"({status}): {_message(text)}")
        self.loaded = path


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(data.get("message", data) if isinstance(data, dict) else data)[:300]


class VllmLoraLink(LocalServer):
    """The run's server in this process with vLLM behind its gateway; publishing loads the new adapter into vLLM."""

    def __init__(self, server: Any, adapters: VllmAdapters, folder: str) -> None:
        super().__init__(server, engine=None)
        self.adapters = adapters
        self.folder = folder

    def publish(self, backend: Any) -> int:
        version = max(self.server.model.version + 1, backend.step)
        path = _load_version(backend, self.adapters, self.folder, version)
        self.server.model.set(version, path)
        logger.info("agl train: vLLM serves adapter v%d as %r (%s)", version, self.adapters.name, path)
        return version


def _load_version(backend: Any, adapters: VllmAdapters, folder: str, version: int) -> str:
    """Write ``backend``'s adapter to ``folder/v{version}``, have vLLM load it, then drop the versions before it
    (those of a run before this one too: vLLM has read the new one). Returns the adapter's folder."""
    path = str(backend.save_adapter(os.path.join(folder, f"v{version}"), version))
    adapters.load(path)
    for name in os.listdir(folder):
        if _VERSION.fullmatch(name) and name != f"v{version}":
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return path


class VllmPoliciesLink(LocalServer):
    """Several policies on vLLM (:mod:`agl_trainer.policies`): after each step every policy's adapter is loaded
    under the policy's own name (``adapters_dir/<policy>/v{version}``), the name the gateway calls it by."""

    def __init__(self, server: Any, adapters: dict[str, VllmAdapters], folder: str) -> None:
        super().__init__(server, engine=None)
        self.adapters = adapters
        self.folder = folder

    def publish(self, backend: Any) -> int:
        version = max(self.server.model.version + 1, backend.step)
        backend.version = version
        for name, adapters in self.adapters.items():
            path = _load_version(backend.backends[name], adapters, os.path.join(self.folder, name), version)
            logger.info("agl train: vLLM serves policy %r's adapter v%d (%s)", name, version, path)
        self.server.model.set(version, self.folder)
        return version
