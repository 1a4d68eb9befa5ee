"""What the bench runs: model presets and the configurations, discovered from the plugin registries.

Every registered strategy runs at every stage (with the strategy's own comm backend and the
``device`` placement); every other registered comm backend and placement policy runs once with
the ``chunk`` strategy at stage 3 (or the first strategy registered, when ``chunk`` is not
installed); every mesh given (``--meshes``, e.g. ``2x2`` for HSDP) runs that strategy at the
``--mesh-stages`` on its own ranks; DDP and FSDP2 are the references, at every world size the
rows use. A plugin that registers a strategy, backend or policy is picked up with no change here.
Policies whose defaults cannot run on this machine get options with ``--placement-options
NAME=JSON``; the built-in offloading policies have presets that offload everything (``static``)
or keep half the model states on the device (``gemini``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from zero_core.plugin import ZeroPlugins

__all__ = ["MODELS", "BenchConfig", "ModelSize", "build_model", "discover", "mesh_name"]


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A model and the per-rank batch it trains on: GPT-shaped, or Llama-shaped when ``ffn`` is set, or
    ``block="mlp"``'s :class:`zero_bench.mlp.ThinMLP` (``layers`` blocks ``d_model`` wide; ``heads`` unused).

    Llama's shapes (``zero_core.testing.llama``): ``kv_heads`` key/value heads (grouped-query
    attention), a SwiGLU MLP ``ffn`` wide, and with ``experts`` a fused mixture of experts.
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int
    batch_size: int
    ffn: int = 0
    kv_heads: int = 0
    experts: int = 0
    block: str = "transformer"

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise ValueError(f"ModelSize.block must be one of {', '.join(BLOCKS)}, got {self.block!r}")

    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


BLOCKS = ("transformer", "mlp")  # ModelSize.block: what each of the model's layers is


def build_model(options: dict[str, Any]) -> Any:
    """The model ``ModelSize(**options)`` describes, on the current default device."""
    if options.get("block") == "mlp":
        from zero_bench.mlp import ThinMLP

        return ThinMLP(vocab=options["vocab"], width=options["d_model"], layers=options["layers"])
    if options.get("ffn"):
        from zero_core.testing.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=options["vocab"], seq_len=options["seq_len"], d_model=options["d_model"],
                                 n_layer=options["layers"], n_head=options["heads"],
                                 n_kv_head=options.get("kv_heads") or options["heads"], ffn=options["ffn"],
                                 n_experts=options.get("experts", 0)))
    from zero_core.testing.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=options["vocab"], seq_len=options["seq_len"], d_model=options["d_model"],
                         n_layer=options["layers"], n_head=options["heads"]))


MODELS = {
    # finishes every configuration of the quick run in well under 5 minutes on 2 CPU cores
    "tiny": ModelSize(vocab=2048, d_model=128, layers=2, heads=4, seq_len=64, batch_size=4),
    # the demo model of examples/train_gpt.py (23.2M parameters)
    "demo": ModelSize(vocab=8192, d_model=512, layers=6, heads=8, seq_len=128, batch_size=4),
    # GPT-2 small's shape (124M parameters), on a sequence short enough for a CPU
    "gpt2-small": ModelSize(vocab=50304, d_model=768, layers=12, heads=12, seq_len=256, batch_size=2),
    # deep and thin (9.8M parameters, 580 tensors in 48 blocks): per-step overhead, not arithmetic, sets its step time
    "thin-48": ModelSize(vocab=2048, d_model=128, layers=48, heads=4, seq_len=64, batch_size=4),
    # Llama's ratios (154M parameters): grouped-query attention, SwiGLU 2752 wide, an untied 32000-token head
    "llama-small": ModelSize(vocab=32000, d_model=1024, layers=8, heads=16, kv_heads=4, ffn=2752, seq_len=128,
                             batch_size=2),
    # 48 blocks of Linear(32, 32) + LayerNorm + GELU (55K parameters): the arithmetic is microseconds, so the step
    # is the host's per-module and per-unit work; the host-overhead section's model (zero_bench.host_overhead)
    "mlp-48": ModelSize(vocab=64, d_model=32, layers=48, heads=1, seq_len=16, batch_size=4, block="mlp"),
    # Mixtral's layout (17.4M parameters): 8 experts fused into [8, 1024, 256] and [8, 256, 512], top-2 routing
    "moe-small": ModelSize(vocab=8192, d_model=256, layers=4, heads=8, kv_heads=2, ffn=512, experts=8, seq_len=64,
                           batch_size=4),
}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One row of the table. ``kind`` is ``zero``, ``ddp`` or ``fsdp2``; the rest applies to ``zero``.

    ``mesh``: ``[R, S]`` (or ``[S]``) shards over a ``DeviceMesh`` of that shape, passed to
    ``shard(mesh=)``; ``world_size``: the ranks the row runs on (``None``: ``--world-size``;
    ``R * S`` for a mesh row).
    """

    name: str
    kind: str
    strategy: str | None = None
    stage: int | None = None
    comm: str | None = None
    placement: str = "device"
    placement_options: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    mesh: list[int] | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if self.mesh is not None:
            mesh = [int(n) for n in self.mesh]
            if self.kind != "zero" or len(mesh) not in (1, 2) or min(mesh) < 1:
                raise ValueError(f"{self.name}: a mesh is [shard] or [replicate, shard] of a zero row, got {self.mesh}")
            if self.world_size not in (None, math.prod(mesh)):
                raise ValueError(f"{self.name}: mesh {mesh} spans {math.prod(mesh)} ranks, not world_size {self.world_size}")
            object.__setattr__(self, "mesh", mesh)
            object.__setattr__(self, "world_size", math.prod(mesh))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def activation_mib(size: ModelSize) -> float:
    """A generous guess of one rank's fp32 activations at the peak of a step (for the ``gemini`` preset).

    Per token: about 34 values of ``d_model`` per layer, the attention scores (5 per head per key
    per layer), and the logits with their softmax and gradient (4 per vocabulary entry).
    """
    per_token = 34 * size.d_model * size.layers + 5 * size.heads * size.seq_len * size.layers + 4 * size.vocab
    return 4 * per_token * size.batch_size * size.seq_len / 2**20


def _preset(policy: str, state_mib: float, size: ModelSize) -> dict[str, Any]:
    """Options for the built-in offloading policies on this run's model (``state_mib``: stage-3 states per rank)."""
    if policy == "static":
        return {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}
    if policy == "gemini":  # half the model states, plus room for the activations the tracer will measure
        return {"device_budget_mb": round(state_mib / 2 + activation_mib(size) + 64, 1)}
    return {}


def mesh_name(mesh: list[int] | tuple[int, ...]) -> str:
    """``hsdp2x2`` for a mesh that shards and replicates, ``mesh1x4`` (``mesh4``, ``mesh4x1``) otherwise."""
    hybrid = len(mesh) == 2 and mesh[0] > 1 and mesh[1] > 1
    return ("hsdp" if hybrid else "mesh") + "x".join(map(str, mesh))


def discover(*, plugins: ZeroPlugins, strategies: list[str] | None, stages: list[int], policies: list[str] | None,
             comms: list[str] | None, references: list[str], precision: str, state_mib: float, size: ModelSize,
             placement_options: dict[str, dict[str, Any]], meshes: list[tuple[int, ...]] = (),
             mesh_stages: list[int] | None = None, world_size: int | None = None) -> list[BenchConfig]:
    """The configurations to run, in table order: references first, then each strategy's stages, then variants,
    then each mesh's stages (after the references at its world size, when that differs from ``world_size``)."""
    configs = [BenchConfig(name=ref, kind=ref) for ref in references]
    strategy_names = plugins.strategies.names() if strategies is None else strategies
    for name in strategy_names:
        plugins.strategies.get(name)  # an unknown name fails here, listing what is registered
    base = "chunk" if "chunk" in strategy_names else (strategy_names[0] if strategy_names else None)
    tag = "" if precision == "fp32" else f"-{precision}"
    for strategy in strategy_names:
        for stage in stages:
            configs.append(BenchConfig(name=f"{strategy}-s{stage}{tag}", kind="zero", strategy=strategy, stage=stage,
                                       precision=precision))
    if base is None:
        return configs
    base_comm = plugins.strategies.get(base).comm
    for comm in plugins.comm_backends.names() if comms is None else comms:
        plugins.comm_backends.get(comm)
        if comm != base_comm:
            configs.append(BenchConfig(name=f"{base}-s3-{comm}{tag}", kind="zero", strategy=base, stage=3, comm=comm,
                                       precision=precision))
    for policy in plugins.placement_policies.names() if policies is None else policies:
        plugins.placement_policies.get(policy)
        if policy == "device":
            continue
        options = placement_options.get(policy, _preset(policy, state_mib, size))
        configs.append(BenchConfig(name=f"{base}-s3-{policy}{tag}", kind="zero", strategy=base, stage=3, placement=policy,
                                   placement_options=json.loads(json.dumps(options)), precision=precision))
    sizes = {world_size}
    for mesh in meshes:
        ranks = math.prod(mesh)
        if ranks not in sizes:  # the loss check and the ratios need plain PyTorch on the same ranks and data
            sizes.add(ranks)
            configs += [BenchConfig(name=f"{ref}-{ranks}ranks", kind=ref, world_size=ranks) for ref in references]
        for stage in stages if mesh_stages is None else mesh_stages:
            configs.append(BenchConfig(name=f"{base}-s{stage}-{mesh_name(mesh)}{tag}", kind="zero", strategy=base, stage=stage,
                                       mesh=list(mesh), precision=precision))
    return configs
