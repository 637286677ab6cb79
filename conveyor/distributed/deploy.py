"""Start a deployment on Ray (a local instance, or an existing cluster via its address).

`conveyor serve --replicas N` starts N replica workers; `--prefill-workers P --decode-workers D`
starts P prefill and D decode workers. Each worker is a Ray actor that loads the model itself, so
on a cluster every node needs conveyor (and the model file at the same path) installed.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from conveyor.config import EngineConfig
from conveyor.distributed.client import RayEngineClient
from conveyor.distributed.router import ROUTING_POLICIES, WorkerHandle
from conveyor.errors import ConfigError, ConveyorError
from conveyor.model.tokenizer import Tokenizer

log = logging.getLogger("conveyor.distributed")


@dataclass
class DeploymentConfig:
    replicas: int = 1
    prefill_workers: int = 0
    decode_workers: int = 0
    ray_address: str | None = None  # None: start a local Ray instance; "auto" or "host:port": join one
    worker_num_cpus: float = 1.0  # what Ray reserves per worker (its num_threads defaults to this)
    routing: str = ROUTING_POLICIES[0]  # cache-aware, or least-load (conveyor.distributed.router)

    def __post_init__(self) -> None:
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ConfigError("disaggregation needs both --prefill-workers and --decode-workers (at least 1 each)")
        if self.prefill_workers < 0 or self.decode_workers < 0 or self.replicas < 1:
            raise ConfigError("worker counts must be positive")
        if self.disaggregated and self.replicas > 1:
            raise ConfigError("use either --replicas or --prefill-workers/--decode-workers, not both")
        if self.worker_num_cpus < 0:
            raise ConfigError("--worker-cpus (worker_num_cpus) must not be negative")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, not {self.routing!r}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    @property
    def distributed(self) -> bool:
        """Anything beyond the single in-process engine (which needs no Ray)."""
        return self.disaggregated or self.replicas > 1 or self.ray_address is not None

    def roles(self) -> list[tuple[str, str]]:
        """(name, role) of every worker to start."""
        if self.disaggregated:
            return [(f"prefill-{i}", "prefill") for i in range(self.prefill_workers)] + [
                (f"decode-{i}", "decode") for i in range(self.decode_workers)
            ]
        return [(f"replica-{i}", "replica") for i in range(self.replicas)]


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer alone (the front end never needs the weights)."""
    from conveyor.model.gguf_loader import read_gguf
    from conveyor.model.loader import resolve_model_path

    path = resolve_model_path(model)
    return Tokenizer.from_gguf(read_gguf(path).metadata) if path.is_file() else Tokenizer.from_hf_folder(path)


def start_deployment(config: EngineConfig, deployment: DeploymentConfig,
                     max_waiting_requests: int | None = None) -> RayEngineClient:
    """Start the workers (and a local Ray instance if none is connected) and wait until every
    worker has loaded the model. The client's `stop()` kills the workers and, if this call started
    Ray, shuts it down."""
    try:
        import ray
    except ImportError:
        raise ConfigError("replicas and prefill/decode workers run on Ray: pip install -e '.[distributed]'") from None

    from conveyor.distributed.worker import EngineWorker

    if deployment.disaggregated and config.scheduler.policy != "continuous":
        raise ConfigError("prefill/decode disaggregation needs the continuous policy")
    roles = deployment.roles()
    started_ray = False
    if not ray.is_initialized():
        if deployment.ray_address is None:
            needed = int(len(roles) * deployment.worker_num_cpus + 0.999)
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
        else:
            _check_reachable(deployment.ray_address)
            try:
                ray.init(address=deployment.ray_address)
            except ConnectionError as exc:
                raise ConfigError(f"cannot join the Ray cluster at {deployment.ray_address!r}: {exc}") from None
        started_ray = True
    if config.num_threads is None:
        config = replace(config, num_threads=max(1, int(deployment.worker_num_cpus)))
    actor_class = ray.remote(EngineWorker)
    workers = [
        WorkerHandle(name, role, actor_class.options(num_cpus=deployment.worker_num_cpus).remote(name, role, config))
        for name, role in roles
    ]
    try:
        infos = ray.get([w.actor.start.remote() for w in workers])
    except BaseException as exc:
        for w in workers:
            ray.kill(w.actor)
        if started_ray:
            ray.shutdown()
        cause = getattr(exc, "cause", None)  # a worker's own error, under Ray's wrapping and remote traceback
        if isinstance(cause, ConveyorError):
            raise cause from None
        raise
    for worker, info in zip(workers, infos):
        worker.info = info
    # Without a prefix cache on the workers there is nothing for the router to aim at.
    routing = deployment.routing if config.enable_prefix_caching else "least-load"
    if routing != deployment.routing:
        log.info("routing %s: prefix caching is off on the workers", routing)
    return RayEngineClient(workers, load_tokenizer(config.model), max_waiting_requests,
                           on_stop=ray.shutdown if started_ray else None, routing=routing)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A host:port cluster address (or ray://host:port) must answer a TCP connection: ray.init retries
    an unreachable one for minutes with only its own warnings. "auto" is Ray's to find."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address!r} (--ray-address): {exc}") from None
