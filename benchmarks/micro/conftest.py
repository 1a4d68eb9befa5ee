"""Two gloo ranks for the micro-benchmarks: this pytest process is rank 0, one helper process is rank 1.

[Note: mirrored benchmarks]
pytest-benchmark times a function in the pytest process, but a collective needs a peer.
So a session fixture (``mirror``) starts this file as a script (``python conftest.py
--peer RENDEZVOUS``): rank 1, which joins rank 0 in a gloo process group through a file
rendezvous and then serves commands read from its stdin, one JSON line each, answering
on its stdout (the only thing it writes there; its log goes to a file).

A benchmark is a *scenario* (:data:`SCENARIOS`): a workload that both ranks build from
the same JSON-able arguments, with a ``run()`` that issues exactly the same collectives
on either rank. ``Mirror.bench`` sends the scenario to the peer, builds it here, and
times ``run()`` with ``benchmark.pedantic(run, setup=..., rounds=ROUNDS,
warmup_rounds=WARMUP)``. The two ranks stay in lockstep through the untimed ``setup``:
it ends with a one-element all-reduce in which rank 0 says "one more round" (1) or
"done" (0), and the peer runs a round for every 1. So the peer never needs to know how
many rounds pytest-benchmark runs (``--benchmark-disable`` runs one, ``--benchmark-
cprofile`` more), and every timed round starts with both ranks aligned, not with the
peer still finishing the previous one. After the last round both ranks run one more,
verified round (``check``: the reduced or gathered values are what they must be) and
the peer reports its per-round counters, which must equal rank 0's.

Every collective has a timeout (:data:`COLLECTIVE_TIMEOUT`, passed to the comm backends
and to the control all-reduce), so a peer that died or diverged fails the benchmark
instead of hanging it; a peer that fails reports its traceback and exits, which closes
its gloo connections and fails rank 0's collective at once. Both processes run with
``torch.set_num_threads(1)``: two ranks on a small machine should not fight over cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_comm import BucketedCommBackend, TorchCommBackend
from zero_core import ChunkPolicy, ZeroConfig
from zero_core.chunks._collectives import gather_group
from zero_core.chunks._group import build_groups
from zero_core.chunks.chunk import BufferPool
from zero_core.plugin import Chunk, CollectiveKind, CommBackend, MemoryTier, ParamInfo, round_up
from zero_core.testing.gpt import GPT, GPTConfig
from zero_strategy_chunk import pack_chunks
from zero_strategy_tensor import TensorStrategy

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
ROUNDS, WARMUP = 25, 3  # about a minute for the whole file on 2 busy cores
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # every collective of a benchmark and the lockstep all-reduce
STARTUP_TIMEOUT = timedelta(seconds=120)  # the peer's start (importing torch on a busy machine) and the rendezvous
_RECORDS: list[dict[str, Any]] = []  # what each benchmark measured, for the terminal summary


# -- the workloads, built identically on both ranks ----------------------------------------------------


def demo_config() -> tuple[GPTConfig, ChunkPolicy]:
    """The demo's model and chunk policy, from ``examples/train_gpt.py``'s default arguments."""
    spec = importlib.util.spec_from_file_location("_train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args([])
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, n_head=args.heads)
    return cfg, ChunkPolicy(chunk_size=args.chunk_size, search_interval=args.d_model)


def demo_params(device: str = "meta") -> list[ParamInfo]:
    """The demo GPT's unique parameters (the tied head counted once) in registration order."""
    cfg, _ = demo_config()
    torch.manual_seed(0)  # the same values on both ranks, as if rank 0 had broadcast them
    with torch.device(device):
        model = GPT(cfg)
    return [ParamInfo(name, p, 0) for name, p in model.named_parameters()]


def demo_chunk_specs(params: list[ParamInfo]) -> list:
    """The chunk strategy's plan for the demo: ``pack_chunks`` with the demo's policy (chunk size searched)."""
    _, policy = demo_config()
    return pack_chunks(params, world_size=WORLD_SIZE, config=ZeroConfig(chunk=policy))


def reduce_scatter_sizes(workload: str) -> list[int]:
    """Elements of each reduce-scatter's input (what one rank passes; it keeps half), in issue order."""
    if workload == "small":
        return [4096] * 200
    if workload == "mixed":
        # 16 x (128 ... 393216): 30 MiB per rank; the largest (1.5 MiB) does not fit a 1 MiB bucket
        return [n for _ in range(16) for n in (128, 1024, 4096, 16384, 65536, 393216)]
    if workload == "demo-tensor":
        # the tensor strategy's gradients: every parameter padded to the world size, reduced in reverse order
        return [round_up(p.numel, WORLD_SIZE) for p in reversed(demo_params())]
    if workload == "demo-chunk":
        # the chunk strategy's gradients: one reduce-scatter per chunk, reverse order
        return [spec.size for spec in reversed(demo_chunk_specs(demo_params()))]
    raise ValueError(f"unknown reduce-scatter workload {workload!r}")


def make_comm(backend: str, bucket_mb: float = 25.0) -> CommBackend:
    if backend == "torch":
        return TorchCommBackend(dist.group.WORLD, timeout=COLLECTIVE_TIMEOUT)
    if backend == "bucketed":
        return BucketedCommBackend(dist.group.WORLD, timeout=COLLECTIVE_TIMEOUT, bucket_size_mb=bucket_mb)
    raise ValueError(f"unknown comm backend {backend!r}")


class Scenario:
    """A workload both ranks build alike; ``run`` is what gets timed. See [Note: mirrored benchmarks]."""

    kind: CollectiveKind
    comm: CommBackend

    def setup(self) -> None:
        """Untimed, before every round: close the previous round's counters."""
        self.comm.stats.end_step()

    def run(self) -> None:
        raise NotImplementedError

    def check(self) -> str | None:
        """One more round whose result is verified; a description of what is wrong, or None."""
        raise NotImplementedError

    def rounds(self) -> list[dict[str, dict[str, int]]]:
        """The counters of every round (the first record is what came before the first round)."""
        return [self.comm.stats.summary(step) for step in list(self.comm.stats.steps)[1:]]

    def info(self) -> dict[str, Any]:
        return {}


class ReduceScatterScenario(Scenario):
    """Reduce-scatter every tensor of a workload: issued asynchronously in order, flushed, waited on.

    That is the engine's pattern in backward: each gradient is handed over as it is ready,
    ``flush()`` comes at the end (launching the bucketed backend's partial buckets), then
    the reductions are waited on. Rank ``r`` sends ``r + 1`` everywhere, so every reduced
    element is ``1 + 2 = 3``.
    """

    kind = CollectiveKind.REDUCE_SCATTER

    def __init__(self, workload: str, backend: str, bucket_mb: float = 25.0) -> None:
        self.sizes = reduce_scatter_sizes(workload)
        self.comm = make_comm(backend, bucket_mb)
        total = sum(self.sizes)
        self.send = torch.full((total,), float(self.comm.rank + 1))
        self.received = torch.zeros(total // WORLD_SIZE)
        self.pairs, offset = [], 0
        for n in self.sizes:
            lo = offset // WORLD_SIZE
            self.pairs.append((self.send[offset : offset + n], self.received[lo : lo + n // WORLD_SIZE]))
            offset += n
        self.backend, self.bucket_mb = backend, bucket_mb

    def run(self) -> None:
        pending = [self.comm.reduce_scatter(out, inp, async_op=True) for inp, out in self.pairs]
        self.comm.flush()
        for p in pending:
            if p is not None:
                p.wait()

    def check(self) -> str | None:
        self.received.zero_()
        self.run()
        expected = float(sum(range(1, WORLD_SIZE + 1)))
        wrong = int((self.received != expected).sum())
        return f"{wrong} of {self.received.numel()} reduced elements are not {expected}" if wrong else None

    def info(self) -> dict[str, Any]:
        out = {"tensors": len(self.sizes), "elements_per_rank_input": sum(self.sizes), "backend": self.backend}
        if self.backend == "bucketed":
            out["bucket_mb"] = self.bucket_mb
        return out


class GatherScenario(Scenario):
    """Gather the demo GPT's parameters from stage-3 shards, group by group, then release every chunk.

    Plans: ``chunk`` (the chunk strategy: ``pack_chunks`` with the demo's searched chunk
    size, one all-gather per chunk), ``tensor-groups`` (the tensor strategy: one chunk per
    parameter, one all-gather per module's gather group) and ``tensor-each`` (the same
    chunks, one all-gather per parameter: ``build_groups(chunks, None, pool)``).
    """

    kind = CollectiveKind.ALL_GATHER

    def __init__(self, plan: str) -> None:
        params = demo_params("cpu")
        self.sums = [float(p.param.detach().double().sum()) for p in params]
        self.params = [p.param for p in params]
        if plan == "chunk":
            specs, declared = demo_chunk_specs(params), None
        elif plan in ("tensor-groups", "tensor-each"):
            shard_plan = TensorStrategy().plan(params, world_size=WORLD_SIZE, config=ZeroConfig(strategy="tensor"))
            specs = list(shard_plan.chunks)
            declared = shard_plan.gather_groups if plan == "tensor-groups" else None
        else:
            raise ValueError(f"unknown gather plan {plan!r}")
        self.comm = make_comm("torch")
        pool = BufferPool()
        self.chunks = []
        for index, spec in enumerate(specs):
            chunk = Chunk(index, spec, rank=self.comm.rank, world_size=WORLD_SIZE, device=torch.device("cpu"), pool=pool, stage=3)
            chunk.pack()  # stage 3: leaves the chunk SHARDED
            self.chunks.append(chunk)
        self.groups = build_groups(self.chunks, declared, pool)
        self.plan = plan

    def run(self) -> None:
        for group in self.groups:
            gather_group(group, self.comm)
        for chunk in self.chunks:
            chunk.release()

    def check(self) -> str | None:
        for group in self.groups:
            gather_group(group, self.comm)
        wrong = [i for i, (p, s) in enumerate(zip(self.params, self.sums)) if float(p.detach().double().sum()) != s]
        for chunk in self.chunks:
            chunk.release()
        return f"parameters {wrong} differ from their values before sharding" if wrong else None

    def info(self) -> dict[str, Any]:
        out = {"chunks": len(self.chunks), "groups": len(self.groups), "elements": sum(c.size for c in self.chunks)}
        if self.plan == "chunk":
            # the searched size: what most chunks have (outliers and the trimmed last chunk differ)
            out["chunk_size"] = Counter(c.size for c in self.chunks).most_common(1)[0][0]
        return out


class PackScenario(Scenario):
    """Pack the demo GPT's parameters into its stage-3 chunks: copy in, keep this rank's shard, release.

    What :func:`zero_core.shard` does per chunk at setup (without the broadcast from rank 0,
    so no collective runs); ``setup`` restores every parameter's own storage first.
    """

    kind = CollectiveKind.BROADCAST  # none is issued: the round must count zero collectives

    def __init__(self) -> None:
        self.infos = demo_params("cpu")
        self.values = [p.param.detach().clone() for p in self.infos]
        self.specs = demo_chunk_specs(self.infos)
        self.comm = make_comm("torch")
        self.chunks: list[Chunk] = []

    def setup(self) -> None:
        super().setup()
        for info, value in zip(self.infos, self.values):
            info.param.data = value.clone()
        self.chunks = []

    def run(self) -> None:
        pool = BufferPool()
        for index, spec in enumerate(self.specs):
            chunk = Chunk(index, spec, rank=self.comm.rank, world_size=WORLD_SIZE, device=torch.device("cpu"), pool=pool, stage=3)
            chunk.pack()
            self.chunks.append(chunk)

    def check(self) -> str | None:
        self.setup()
        self.run()
        flat = torch.cat([v.reshape(-1) for v in self.values])
        offset, wrong = 0, []
        for chunk in self.chunks:
            begin = offset + chunk.rank * chunk.shard_size
            real = max(0, min(chunk.shard_size, chunk.used - chunk.rank * chunk.shard_size))
            if not torch.equal(chunk.shard[:real], flat[begin : begin + real]):
                wrong.append(chunk.index)
            offset += chunk.used
        return f"chunks {wrong} hold other values than the parameters' slices" if wrong else None

    def info(self) -> dict[str, Any]:
        return {"chunks": len(self.specs), "elements": sum(s.size for s in self.specs)}


class PlacementScenario(Scenario):
    """Move every chunk's master shard and optimizer states of the demo GPT to another tier and back.

    The model is sharded with the ``static`` policy (everything on the device tier, a disk
    tier configured) and trained one step so that Adam's states exist. ``route``
    ``device-host`` moves shards and states down to host memory and up again (pinned copies
    on CUDA; plain copies on a CPU machine); ``host-disk`` moves them from host memory to
    the disk tier's files and back. No collective runs during a round.
    """

    kind = CollectiveKind.BROADCAST  # none is issued

    def __init__(self, route: str) -> None:
        import tempfile

        from zero_core import shard
        from zero_core.testing.gpt import SyntheticTokens, lm_loss
        from zero_offload._tiers import Part

        cfg, policy = demo_config()
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # one path on both ranks (the configs must agree); the tier makes a private directory per rank in it
        self.dir = os.path.join(tempfile.gettempdir(), "zero-micro-disk")
        options = {"offload_optim_frac": 0.0, "offload_param_frac": 0.0, "disk_dir": self.dir}
        config = ZeroConfig(chunk=policy, placement="static", placement_options=options,
                            collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
        self.model, optimizer = shard(model, optimizer, config=config)
        tokens = SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len).batch(0, 2)
        lm_loss(self.model(tokens), tokens).backward()
        optimizer.step()
        self.comm = self.model.engine.comm
        self.tiers = self.model.engine.placement.tiers
        self.chunks = self.model.engine.chunks
        self.parts = (Part.PARAMS, Part.OPTIM)
        self.path = {"device-host": (MemoryTier.HOST, MemoryTier.DEVICE), "host-disk": (MemoryTier.DISK, MemoryTier.HOST)}[route]
        if route == "host-disk":
            for chunk in self.chunks:
                for part in self.parts:
                    self.tiers.move(chunk, part, MemoryTier.HOST)
        self.before = [chunk.shard.clone() for chunk in self.chunks]
        self.route = route

    def run(self) -> None:
        away, back = self.path
        for chunk in self.chunks:
            for part in self.parts:
                self.tiers.move(chunk, part, away)
        for chunk in self.chunks:
            for part in self.parts:
                self.tiers.move(chunk, part, back)

    def check(self) -> str | None:
        self.run()
        wrong = [c.index for c, b in zip(self.chunks, self.before) if not torch.equal(c.shard, b)]
        self.model.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # both ranks' private directories are gone by now; rank 1 may race: harmless
        return f"chunks {wrong} came back with other values" if wrong else None

    def info(self) -> dict[str, Any]:
        moved = sum(self.tiers.nbytes(c, p) for c in self.chunks for p in self.parts)
        return {"chunks": len(self.chunks), "bytes_moved_each_way": moved, "route": self.route}


SCENARIOS: dict[str, type[Scenario]] = {"reduce_scatter": ReduceScatterScenario, "gather": GatherScenario, "pack": PackScenario,
                                        "placement": PlacementScenario}


def control(value: int) -> int:
    """The lockstep all-reduce (max): rank 0's 1 means "one more round", 0 "done"; the peer sends 0."""
    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait(timeout=COLLECTIVE_TIMEOUT)
    return int(flag.item())


# -- rank 1: the peer ------------------------------------------------------------------------------------


def peer_main(init_file: str) -> int:
    """Serve scenarios as rank 1 until told to exit. Protocol: one JSON object per line each way."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel ...
    os.dup2(2, 1)  # ... and anything else printed goes to the log

    def say(**message: Any) -> None:
        answer.write(json.dumps(message) + "\n")

    torch.set_num_threads(1)
    say(event="started", pid=os.getpid())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=1, world_size=WORLD_SIZE, timeout=STARTUP_TIMEOUT)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "exit":
                break
            scenario = SCENARIOS[command["scenario"]](**command["kwargs"])
            say(event="built")
            while True:
                scenario.setup()  # before the control round, so it is not in rank 0's timed round
                if not control(0):
                    break
                scenario.run()
            problem = scenario.check()
            say(event="done", rounds=scenario.rounds(), check=problem)
            del scenario
    except BaseException:
        say(event="error", traceback=traceback.format_exc())
        return 1  # leaving closes this rank's connections: rank 0's collective fails at once
    finally:
        dist.destroy_process_group()
    return 0


# -- rank 0: pytest's side -------------------------------------------------------------------------------


class PeerError(AssertionError):
    """The peer failed, died, or its counters differ from rank 0's."""


class Mirror:
    """Rank 0's handle on the peer; :meth:`bench` runs a scenario on both ranks under pytest-benchmark."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc, self.log = proc, log
        self.broken: str | None = None
        self.records = _RECORDS  # for the terminal summary
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)  # the peer closed its stdout: it exited

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: timedelta) -> dict[str, Any]:
        try:
            message = self._lines.get(timeout=timeout.total_seconds())
        except queue.Empty:
            message = {"event": "timeout"}
        if message is None or message["event"] != event:
            if message is None:
                why = f"the peer exited (code {self.proc.poll()})"
            elif message["event"] == "error":
                why = f"the peer failed:\n{message['traceback']}"
            elif message["event"] == "timeout":
                why = f"no answer from the peer within {timeout.total_seconds():.0f}s"
            else:
                why = f"the peer answered {message!r}"
            self.broken = f"waiting for {event!r}: {why}"
            raise PeerError(f"{self.broken}\n--- peer log (tail) ---\n{self.log_tail()}")
        return message

    def bench(self, benchmark: Any, scenario: str, **kwargs: Any) -> dict[str, Any]:
        """Time ``SCENARIOS[scenario](**kwargs).run()`` on both ranks; fill ``benchmark.extra_info``.

        Returns the per-round counters (``{"calls": ..., "bytes_sent": ...}`` of the
        scenario's collective kind), the same in every round and on both ranks.
        """
        if self.broken is not None:
            pytest.fail(f"the 2-rank setup broke earlier ({self.broken}); later benchmarks cannot run")
        self.send(cmd="run", scenario=scenario, kwargs=kwargs)
        try:
            work = SCENARIOS[scenario](**kwargs)
            self.expect("built", STARTUP_TIMEOUT)

            def setup() -> None:
                work.setup()
                control(1)

            benchmark.pedantic(work.run, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
            control(0)
        except PeerError:
            raise
        except BaseException:
            self.broken = self.broken or "a benchmark raised on rank 0 in the middle of its rounds"
            raise
        work.comm.stats.end_step()  # the peer's last setup closed its last round the same way
        problem = work.check()
        reply = self.expect("done", COLLECTIVE_TIMEOUT)
        assert problem is None, f"rank 0: {problem}"
        assert reply["check"] is None, f"rank 1: {reply['check']}"
        rounds = work.rounds()
        if rounds != reply["rounds"]:
            raise PeerError(f"the ranks' counters differ: rank 0 {rounds}, rank 1 {reply['rounds']}")
        if any(r != rounds[0] for r in rounds):
            raise PeerError(f"the rounds' counters differ: {rounds}")
        counts = rounds[0].get(work.kind.value, {"calls": 0, "bytes_sent": 0}) if rounds else {"calls": 0, "bytes_sent": 0}
        other = {k: v for k, v in rounds[0].items() if k != work.kind.value} if rounds else {}
        assert not other, f"a round issued collectives besides {work.kind.value}: {other}"
        extra = {f"{work.kind.value}_calls": counts["calls"], "bytes_sent": counts["bytes_sent"], **work.info()}
        benchmark.extra_info.update(extra)
        stats = getattr(benchmark, "stats", None)
        median = stats.stats.median if stats is not None else None
        self.records.append({"group": benchmark.group, "name": benchmark.name, "median_s": median, **extra})
        return counts


@pytest.fixture(scope="session")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirror]:
    """This process as rank 0 of a 2-rank gloo group, with the peer as rank 1. See [Note: mirrored benchmarks]."""
    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this pytest process; run benchmarks/micro on its own")
    tmp = tmp_path_factory.mktemp("micro-gloo")
    init_file, log = tmp / "rendezvous", tmp / "peer.log"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--peer", str(init_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    mirror = Mirror(proc, log)
    try:
        mirror.expect("started", STARTUP_TIMEOUT)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=WORLD_SIZE, timeout=STARTUP_TIMEOUT)
        yield mirror
    finally:
        try:
            if proc.poll() is None:
                mirror.send(cmd="exit")
            proc.wait(timeout=COLLECTIVE_TIMEOUT.total_seconds() + 10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(threads)
        if proc.returncode != 0 and mirror.broken is None:
            raise PeerError(f"the peer exited with code {proc.returncode}\n--- peer log (tail) ---\n{mirror.log_tail()}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The counters pytest-benchmark's table leaves out: collective calls and bytes sent per round."""
    if not _RECORDS:
        return
    tr = terminalreporter
    tr.section("micro-benchmark counters (per round, per rank)")
    tr.write_line(f"{'group':<44} {'benchmark':<54} {'median ms':>10} {'calls':>6} {'MiB sent':>9}")
    for r in _RECORDS:
        calls = r.get("reduce_scatter_calls", r.get("all_gather_calls", r.get("broadcast_calls", 0)))
        median = f"{r['median_s'] * 1e3:10.2f}" if r["median_s"] is not None else f"{'-':>10}"
        tr.write_line(f"{r['group'] or '':<44} {r['name']:<54} {median} {calls:>6} {r['bytes_sent'] / 2**20:>9.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="rank 1 of the micro-benchmarks (started by the mirror fixture)")
    parser.add_argument("--peer", required=True, metavar="RENDEZVOUS_FILE")
    sys.exit(peer_main(parser.parse_args().peer))
