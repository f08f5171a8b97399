"""WorkerActor: one tensor-parallel rank of an engine replica of tensor-parallel size > 1, in a process of its own
(a replica of one rank runs it in the SchedulerActor: rank.py's ``LocalSteps``).

The ranks of a replica join one torch.distributed group (gloo on CPU, nccl on CUDA); rank 0 picks the
rendezvous address on a free port. Every rank receives every SchedulerOutput; only rank 0 returns its
ModelRunnerOutput in its ``StepReply`` (the others reply empty, keeping the hop small). The rank itself (its model
thread, runner, guard, metrics) is rank.py's ``Rank``; this actor gives Ray's calls and the step hop to it: the
step channel of cluster/channel/steps.py, served on the model thread, or a compiled graph's ``execute_model``. The
actor's own thread stays free for pings.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import ray

from cbserve.cluster.channel.messages import StepMessage, StepReply
from cbserve.cluster.channel.steps import StepServer
from cbserve.cluster.channel.transport import StepAddress
from cbserve.cluster.engine.rank import Rank
from cbserve.config import CBServeConfig


@ray.remote(max_restarts=0, max_concurrency=1, concurrency_groups={"lifetime": 1})
class WorkerActor:
    def __init__(self, config: dict[str, Any], rank: int, replica: str) -> None:
        self.rank = Rank(CBServeConfig.model_validate(config), rank, replica)
        self.step_server: StepServer | None = None

    # ---- set-up ---------------------------------------------------------------------------
    def node_ip_and_free_port(self) -> tuple[str, int]:
        """Rank 0 only: the address the other ranks rendezvous at."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        self.rank.call(self.rank.init_distributed, master_addr, master_port)

    def load_model(self) -> int:
        """Load this rank's shard and size the KV cache; returns the number of KV blocks it can hold."""
        return self.rank.call(self.rank.load_model)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.rank.call(self.rank.init_kv_cache, num_blocks)

    # ---- the per-iteration call -----------------------------------------------------------
    def execute_model(self, scheduler_output: StepMessage) -> StepReply:
        """One step (a compiled graph's call; the step channel runs ``Rank.execute`` on the model thread itself)."""
        return self.rank.call(self.rank.execute, scheduler_output)

    def open_step_channel(self) -> StepAddress:
        """Serve the steps over a socket (cluster/channel/steps.py) from the model thread: the scheduler's
        per-step hop when it does not use a compiled graph. The model thread serves it until it closes."""
        if self.step_server is not None:
            raise RuntimeError("the step channel is already open")
        self.step_server = StepServer(self.rank.execute, ray.util.get_node_ip_address())
        self.rank.submit(self.step_server.serve)
        return self.step_server.address

    # ---- an RL loop's weights: taken in on this actor's thread while the steps go on (rank.py) -------
    def stage_weights(self, weights: list[Any]) -> int:
        """Fetch the weights a trainer put in the object store (``[ref]``: the reference, not resolved by Ray)."""
        return self.rank.stage(ray.get(weights[0]))

    def join_weight_group(self, info: Any) -> None:
        self.rank.join_weight_group(info)

    def receive_weights(self) -> int:
        return self.rank.receive_weights()

    def path_trace(self, command: str) -> dict[str, list[str]]:
        """Record the files the model thread runs from its next step on ("start"), or stop and return them ("stop"):
        path_trace.py."""
        return self.rank.path.command_later(command)

    @ray.method(concurrency_group="lifetime")
    def lifetime(self) -> None:
        """Never returns: its reference fails the moment Ray knows this actor is gone (a compiled graph's liveness
        signal, compiled_graph.py; the step channel's is its socket)."""
        threading.Event().wait()

    # ---- introspection (tests, health) --------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {**self.rank.info(), "node_id": ray.get_runtime_context().get_node_id()}
