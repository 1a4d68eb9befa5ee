"""A DeepSpeed config's ``scheduler`` section trains at DeepSpeed's learning rates, in a plain loop and under
``ZeroTrainer``; the import report files switched-off features as no effect and states the compute dtype.

The learning rates are checked against DeepSpeed's formulas written out below from its source
(``deepspeed/runtime/lr_schedules.py``, master at commit 22779f2c; DeepSpeed builds the scheduler with
``last_batch_iteration = -1`` and steps it after every optimizer step, so step ``s`` runs at ``f(s - 1)``), not
against zero's implementation. ``ZeroTrainer(deepspeed=config)`` at 1 and 2 ranks (one spawn per world size; every
schedule at 1 rank, two at 2 ranks in the suite and all six under ``nox -s soak``) is compared with the plain
``transformers.Trainer`` in one process given the same schedule (a scheduler built from these formulas): losses,
pre-clip gradient norms and final weights within 1e-5 (fp32, as the other Trainer parity tests), every step's learning
rate (and OneCycle's betas) within 1e-12 of the formulas.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import pytest
import torch
import torch.distributed as dist

from zero_core import ConfigError, convert_deepspeed_config, deepspeed_lr_scheduler
from zero_core.testing import run_distributed

# -- DeepSpeed's formulas, from deepspeed/runtime/lr_schedules.py ----------------------------------------------------


def _gamma(p: dict, i: int) -> float:
    steps = max(2, p.get("warmup_num_steps", 1000))
    if p.get("warmup_type", "log") == "linear":
        return i / steps
    return (1.0 / math.log(steps)) * math.log(i + 1)


def ds_lr(kind: str, p: dict, i: int, base_lr: float) -> float:
    """The learning rate DeepSpeed's ``kind`` sets at ``last_batch_iteration = i`` (``-1``: what its constructor sets)."""
    if kind in ("WarmupLR", "WarmupDecayLR"):
        low = p.get("warmup_min_lr", 0.0)
        high = p.get("warmup_max_lr", base_lr if kind == "WarmupLR" else 0.001)
        if i < 0:
            return low
        steps = max(2, p.get("warmup_num_steps", 1000))
        if i < steps:
            gamma = _gamma(p, i)
        elif kind == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, float(p["total_num_steps"] - i) / float(max(1.0, p["total_num_steps"] - steps)))
        return low + (high - low) * gamma
    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        steps = max(2, p.get("warmup_num_steps", 1000))
        if i < steps:
            low = p.get("warmup_min_ratio", 0.0)
            return base_lr * (low + _gamma(p, i) * (1.0 - low))
        progress = min(1.0, (i - steps + 1) / max(1, p["total_num_steps"] - steps))
        floor = p.get("cos_min_ratio", 0.0001)
        return base_lr * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    if kind == "LRRangeTest":
        size, rate = p.get("lr_range_test_step_size", 2000), p.get("lr_range_test_step_rate", 1.0)
        interval = math.floor((i + 1) / size) if p.get("lr_range_test_staircase", False) else (i + 1) / size
        return p.get("lr_range_test_min_lr", 1e-3) * (1 + rate * interval)
    assert kind == "OneCycle"
    low, high = p["cycle_min_lr"], p["cycle_max_lr"]
    if i < 0:
        return low
    total = _cycle_total(p)
    if i < total:
        return low + (high - low) * _scale(p, i)
    if p.get("decay_step_size", 0) == 0 or p.get("decay_lr_rate", 0.0) == 0:
        return low
    return low / (1 + p["decay_lr_rate"] * (i - total + 1) / p["decay_step_size"])


def _cycle_total(p: dict) -> float:
    first = float(p.get("cycle_first_step_size", 2000))
    return first + float(p.get("cycle_second_step_size") or first)


def _scale(p: dict, i: int) -> float:
    first, total = float(p.get("cycle_first_step_size", 2000)), _cycle_total(p)
    batch = i + 1
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    up = x <= first / total
    scale = x / (first / total) if up else (x - 1) / (first / total - 1)
    stairs = p.get("cycle_first_stair_count", 0)
    if not up and p.get("cycle_second_stair_count") is not None:
        stairs = p["cycle_second_stair_count"]
    if stairs > 0:
        within = batch % total
        position = within * stairs / first if within <= first else (total - within) * stairs / (total - first)
        scale = math.floor(position) / stairs
    return scale


def ds_beta1(p: dict, i: int) -> float:
    """OneCycle's first beta at ``last_batch_iteration = i`` (the second is 0.99)."""
    low, high = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    if i < 0:
        return low
    if i < _cycle_total(p):
        return high - (high - low) * _scale(p, i)
    if p.get("decay_step_size", 0) == 0 or p.get("decay_mom_rate", 0.0) == 0:
        return high
    return high * (1 + p["decay_mom_rate"] * (i - _cycle_total(p) + 1) / p["decay_step_size"])


# -- the schedules tested, in the plain loop (many steps, every phase) and under the Trainer (8 steps) ---------------

LR = 2e-3
STEPS, WARMUP = 8, 3  # Trainer runs: training steps and TrainingArguments.warmup_steps (what "auto" warmup becomes)
SCHEDULES = {
    # HF's ZeRO-3 "auto" config's section
    "WarmupLR": {"type": "WarmupLR",
                 "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "WarmupDecayLR": {"type": "WarmupDecayLR",
                      "params": {"total_num_steps": "auto", "warmup_min_lr": 1e-4, "warmup_max_lr": "auto",
                                 "warmup_num_steps": WARMUP, "warmup_type": "linear"}},
    "WarmupCosineLR": {"type": "WarmupCosineLR",
                       "params": {"total_num_steps": "auto", "warmup_min_ratio": 0.1, "warmup_num_steps": "auto",
                                  "cos_min_ratio": 0.05}},
    "OneCycle": {"type": "OneCycle",
                 "params": {"cycle_min_lr": 2e-4, "cycle_max_lr": LR, "cycle_first_step_size": 3,
                            "cycle_second_step_size": 2, "decay_step_size": 1, "decay_lr_rate": 0.5,
                            "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}},
    "OneCycle-stairs": {"type": "OneCycle",
                        "params": {"cycle_min_lr": 2e-4, "cycle_max_lr": LR, "cycle_first_step_size": 4,
                                   "cycle_first_stair_count": 2, "cycle_momentum": False}},
    "LRRangeTest": {"type": "LRRangeTest",
                    "params": {"lr_range_test_min_lr": 5e-4, "lr_range_test_step_size": 2,
                               "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}},
}


def filled(name: str, total: int = STEPS, warmup: int = WARMUP) -> tuple[str, dict]:
    """The section's type and params with "auto" filled as HF fills it."""
    section = SCHEDULES[name]
    fill = {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "total_num_steps": total, "warmup_num_steps": warmup}
    return section["type"], {k: fill[k] if v == "auto" else v for k, v in section["params"].items()}


def expected(name: str, steps: int = STEPS, total: int = STEPS) -> tuple[list[float], list[float] | None]:
    kind, p = filled(name, total)
    lrs = [ds_lr(kind, p, s - 1, LR) for s in range(steps)]
    betas = [ds_beta1(p, s - 1) for s in range(steps)] if kind == "OneCycle" and p.get("cycle_momentum", True) else None
    return lrs, betas


# -- the plain loop ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_step_runs_at_deepspeeds_learning_rate_and_a_state_dict_resumes(name):
    steps = 40  # through every phase: warmup, hold or decay, OneCycle's decay after the cycle
    kind, params = filled(name, total=30, warmup=5)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = deepspeed_lr_scheduler(optimizer, {"scheduler": SCHEDULES[name]}, total_num_steps=30,
                                       warmup_num_steps=5, learning_rate=LR)
    momentum = kind == "OneCycle" and params.get("cycle_momentum", True)
    seen, saved = [], None
    for step in range(steps):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group["betas"]))
        if step == 17:
            saved = (scheduler.state_dict(), optimizer.state_dict())
        optimizer.step()
        scheduler.step()
    for step, (lr, betas) in enumerate(seen):
        assert lr == pytest.approx(ds_lr(kind, params, step - 1, LR), abs=1e-15), (name, step)
        want = (ds_beta1(params, step - 1), 0.99) if momentum else (0.9, 0.999)
        assert betas == pytest.approx(want, abs=1e-15), (name, step)
    # a new scheduler loaded from step 17's state continues the schedule from there
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.load_state_dict(saved[1])
    optimizer.param_groups[0]["lr"] = 1.0  # both overwritten by the scheduler's load
    if momentum:
        optimizer.param_groups[0]["betas"] = (0.5, 0.5)
    resumed = deepspeed_lr_scheduler(optimizer, {"scheduler": SCHEDULES[name]}, total_num_steps=30,
                                     warmup_num_steps=5, learning_rate=LR)
    resumed.load_state_dict(saved[0])
    for step in range(17, steps):
        assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"]) == seen[step], (name, step)
        optimizer.step()
        resumed.step()


def test_per_group_values_and_what_is_refused():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    scheduler = deepspeed_lr_scheduler(optimizer, {"type": "WarmupLR", "params": {
        "warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 2.0], "warmup_num_steps": 4, "warmup_type": "linear"}})
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.0, 0.1])  # f(0) of a linear warmup
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.25, 0.575])
    # a step skipped by an fp16 overflow does not advance the schedule, as under DeepSpeed
    skipped = [True]
    held = deepspeed_lr_scheduler(optimizer, {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.1}},
                                  skip_step=lambda: skipped[0])
    held.step()
    assert held.last_epoch == 0 and held.get_last_lr() == [0.1, 0.1] and "skip_step" not in held.state_dict()
    skipped[0] = False
    held.step()
    assert held.last_epoch == 1 and held.get_last_lr() == pytest.approx([0.1 * (1 + 1 / 2000)] * 2)
    # OneCycle on an optimizer without betas leaves its momentum alone, as DeepSpeed does
    cycle = deepspeed_lr_scheduler(optimizer, {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}})
    assert "betas" not in optimizer.param_groups[0] and cycle.get_last_lr() == [0.1, 0.1]
    refusals = [
        ({"type": "WarmupRestarts"}, "not a DeepSpeed scheduler; DeepSpeed has WarmupLR"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "scheduler.params.warmup_steps: WarmupLR has no such"),
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}, "needs scheduler.params.total_num_steps"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}, "(pass total_num_steps=)"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "must be a positive whole number"),
    ]
    for section, message in refusals:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            deepspeed_lr_scheduler(optimizer, {"scheduler": section})


# -- the import report ---------------------------------------------------------------------------------------------


def test_the_report_files_switched_off_features_as_no_effect_and_states_the_compute_dtype():
    off = {"zero_optimization": {"stage": 3, "memory_efficient_linear": False, "zeropp_loco_param": None},
           "fp16": {"enabled": False}, "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"},
           "zero_force_ds_cpu_optimizer": False, "data_efficiency": {"enabled": False},
           "progressive_layer_drop": {"enabled": False}, "elasticity": {"enabled": False},
           "autotuning": {"enabled": False}, "hybrid_engine": {"enabled": False}, "nebula": {"enabled": False},
           "torch_autocast": {"enabled": False}, "amp": {"enabled": False}, "sparse_gradients": False,
           "disable_allgather": False, "sequence_parallel_size": 1, "tensor_parallel": {"autotp_size": 1},
           "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}},
                                    "activation_quantization": {"shared_parameters": {"enabled": False}}}}
    conversion = convert_deepspeed_config(off)
    assert conversion.unmapped == {}, conversion.unmapped
    for key in set(off) - {"zero_optimization", "fp16"}:
        assert key in conversion.no_ops, key
    # DeepSpeed trains fp32 with fp16 off and no bf16 section; so does the converted config, and the report says so
    assert conversion.config.precision.compute is None
    assert "precision.compute stays None" in conversion.no_ops["fp16.enabled"]
    assert "fp32" in conversion.no_ops["fp16.enabled"]
    # switched on, the same keys still change training
    on = {"zero_optimization": {"stage": 3}, "curriculum_learning": {"enabled": True}, "zero_force_ds_cpu_optimizer": True,
          "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}
    assert sorted(convert_deepspeed_config(on).unmapped) == ["compression_training", "curriculum_learning",
                                                             "zero_force_ds_cpu_optimizer"]
    # HF's "auto" precision filled from bf16=True arguments: the fp16 switch-off names the bf16 the config computes in
    args = type("Args", (), {"bf16": True, "fp16": False})()
    auto = convert_deepspeed_config({"zero_optimization": {"stage": 3}, "fp16": {"enabled": "auto"},
                                     "bf16": {"enabled": "auto"}}, training_args=args)
    assert auto.config.precision.compute is torch.bfloat16
    assert auto.no_ops["fp16.enabled"].startswith("false: the converted config computes in bf16"), auto.no_ops
    assert "fp32" not in auto.no_ops["fp16.enabled"]


def test_the_report_names_the_helper_for_a_scheduler_section():
    conversion = convert_deepspeed_config({"zero_optimization": {"stage": 2}, "scheduler": SCHEDULES["WarmupLR"]})
    text = conversion.unmapped["scheduler"]
    assert text.startswith("DeepSpeed's WarmupLR schedule: build it with zero_core.deepspeed_lr_scheduler"), text
    assert "'auto' warmup_min_lr, warmup_max_lr, warmup_num_steps" in text
    bad = convert_deepspeed_config({"zero_optimization": {"stage": 2}, "scheduler": {"type": "Cosine"}})
    assert "not a DeepSpeed scheduler" in bad.unmapped["scheduler"]


# -- under ZeroTrainer, against the plain Trainer ---------------------------------------------------------------------

VOCAB, SEQ, SAMPLES, BATCH = 96, 16, 32, 4  # 8 steps of 4 sequences
TOL = 1e-5
# the ranks build Trainers: the suite's fork server imports it once (tests/conftest.py)
SPAWN_PRELOAD = ("transformers.trainer",)
ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}  # Accelerate insists on them
DS = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
RESUMED = ("WarmupCosineLR", "OneCycle")  # resumed from checkpoint-4 at 1 rank
# At 2 ranks the suite runs WarmupLR (TrainingArguments(deepspeed=...) is compared with it) and OneCycle (the one that
# also sets betas): a schedule only sets param_groups, which every rank does alike, and each schedule's rates are
# checked at 1 rank against the reference and in the plain loop. `nox -s soak` (ZERO_SOAK=1) runs all six at 2 ranks.
TWO_RANKS = list(SCHEDULES) if os.environ.get("ZERO_SOAK") else ["WarmupLR", "OneCycle"]


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(output_dir: str, per_device: int, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=LR,
                    lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=0.5, logging_steps=1,
                    save_strategy="no", report_to=[], use_cpu=True, seed=0, train_sampling_strategy="sequential",
                    dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no")
    settings.update(overrides)
    return TrainingArguments(**settings)


def _recorder():
    from transformers import TrainerCallback

    class Rates(TrainerCallback):
        """The learning rate and betas each optimizer step runs at."""

        def __init__(self):
            self.lrs, self.betas = [], []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            group = optimizer.param_groups[0]
            self.lrs.append(float(group["lr"]))
            self.betas.append(tuple(group["betas"]))

    return Rates()


def _run(trainer, rates, resume=None) -> dict:
    trainer.train(resume_from_checkpoint=resume)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    out = {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs], "lrs": rates.lrs,
           "betas": rates.betas}
    if hasattr(trainer.model, "full_state_dict"):
        out["params"] = trainer.model.full_state_dict()  # collective; rank 0 holds it
        trainer.model.close()
    else:
        out["params"] = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    return out


def _deepspeed_arguments(output_dir: str, per_device: int, ds: dict):
    """TrainingArguments(deepspeed=ds), as HF users write it. Without DeepSpeed installed transformers refuses to build
    it, so this sets what its __post_init__ sets: ``deepspeed`` and Accelerate's DeepSpeedPlugin."""
    if importlib.util.find_spec("deepspeed") is not None:
        return arguments(output_dir, per_device, deepspeed=ds)
    from accelerate.utils import DeepSpeedPlugin

    args = arguments(output_dir, per_device)
    args.deepspeed = ds
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=dict(ds))
    return args


def zero_rank(output_dir: str, names: list[str]) -> dict:
    """The ``names`` schedules under ZeroTrainer(deepspeed=...); at 1 rank also resuming and the refusals, at 2 ranks
    also TrainingArguments(deepspeed=...)."""
    from zero_integrations.hf import ZeroTrainer

    world = dist.get_world_size()
    per_device = BATCH // world
    out: dict = {}
    for name in names:
        section = SCHEDULES[name]
        rates = _recorder()
        save = world == 1 and name in RESUMED
        args = arguments(f"{output_dir}/{name}", per_device, save_strategy="steps" if save else "no", save_steps=4)
        trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), callbacks=[rates],
                              deepspeed={**DS, "scheduler": section})
        out[name] = _run(trainer, rates)
        if save:  # a new trainer resumes mid-schedule (in OneCycle's cycle, in the cosine's decay)
            rates = _recorder()
            trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), callbacks=[rates],
                                  deepspeed={**DS, "scheduler": section})
            out[f"{name} resumed"] = _run(trainer, rates, resume=f"{output_dir}/{name}/checkpoint-4")
    if world == 2:
        rates = _recorder()
        args = _deepspeed_arguments(f"{output_dir}/args", per_device, {**DS, "scheduler": SCHEDULES["WarmupLR"]})
        trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), callbacks=[rates])
        out["arguments"] = _run(trainer, rates)
        out["arguments"]["plugin"] = trainer.accelerator.state.deepspeed_plugin
        from transformers.integrations import is_deepspeed_zero3_enabled

        out["arguments"]["zero3"] = is_deepspeed_zero3_enabled()  # from_pretrained must not use zero.Init now
    else:
        out["refused"], out["accepted"] = _refusals(f"{output_dir}/refused", per_device)
    return out


def _refusals(output_dir: str, per_device: int) -> tuple[list[str], int]:
    """What ZeroTrainer refuses of a DeepSpeed config rather than change training silently, and what it accepts."""
    from zero_integrations.hf import ZeroTrainer

    partitioned = build_model()
    next(partitioned.parameters()).ds_id = 0  # what from_pretrained under TrainingArguments(deepspeed=<ZeRO-3>) leaves
    attempts = [  # (model, DeepSpeed config, whether only train() can tell)
        (None, {**DS, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}, True),
        (None, {**DS, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}, True),
        (None, {**DS, "scheduler": {"type": "Cosine"}}, False),
        (partitioned, DS, False),
        # the Trainer builds the optimizer from the arguments: another optimizer or other settings are refused
        (None, {**DS, "optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, False),
        (None, {**DS, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, False),
        (None, {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, False),
        (None, {**DS, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, False),
        # accepted: HF's "auto" section, and one that says what the arguments say
        (None, {**DS, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                  "weight_decay": "auto"}}}, False),
        (None, {**DS, "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                  "weight_decay": 0.0}}}, False),
    ]
    refused, accepted = [], 0
    for model, ds, at_train in attempts:
        try:
            trainer = ZeroTrainer(model=model or build_model(), args=arguments(output_dir, per_device),
                                  train_dataset=dataset(), deepspeed=ds)
            if at_train:
                trainer.train()
            accepted += 1
        except ConfigError as err:
            refused.append(str(err))
    return refused, accepted


class FormulaLR(torch.optim.lr_scheduler.LRScheduler):
    """The reference's scheduler: this file's transcription of DeepSpeed's formulas (and OneCycle's betas)."""

    def __init__(self, optimizer, name: str):
        self.kind, self.p = filled(name)
        self.momentum = self.kind == "OneCycle" and self.p.get("cycle_momentum", True)
        super().__init__(optimizer)

    def get_lr(self):
        return [ds_lr(self.kind, self.p, self.last_epoch - 1, base) for base in self.base_lrs]

    def step(self, epoch=None):
        super().step(epoch)
        if self.momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (ds_beta1(self.p, self.last_epoch - 1), 0.99)


def reference_rank(output_dir: str) -> dict:
    """The plain Trainer in one process, the whole batch per step, each schedule given as FormulaLR."""
    from transformers import Trainer

    class Reference(Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = FormulaLR(self.optimizer if optimizer is None else optimizer, self.schedule)
            return self.lr_scheduler

    out = {}
    for name in SCHEDULES:
        rates = _recorder()
        trainer = Reference(model=build_model(), args=arguments(f"{output_dir}/{name}", BATCH),
                            train_dataset=dataset(), callbacks=[rates])
        trainer.schedule = name
        out[name] = _run(trainer, rates)
    return out


@functools.cache
def _reference(tmp: str) -> dict:
    return run_distributed(reference_rank, 1, tmp, timeout=300, env=ENV)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(str(tmp_path_factory.mktemp("ds_sched_reference")))


def _assert_matches(got: dict, want: dict, name: str, tol: float = TOL) -> None:
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], abs=tol, rel=tol), (name, key, got[key], want[key])
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        diff = (got["params"][key].float() - value.float()).abs().max().item()
        assert diff <= tol, f"{name} {key}: max abs diff {diff} > {tol}"


def _assert_rates(got: dict, name: str, first: int = 0) -> None:
    lrs, betas = expected(name)
    assert got["lrs"] == pytest.approx(lrs[first:], abs=1e-12, rel=0), (name, got["lrs"], lrs[first:])
    if betas is not None:
        assert [b[0] for b in got["betas"]] == pytest.approx(betas[first:], abs=1e-12), name
        assert {b[1] for b in got["betas"]} == {0.99}, name
    else:
        assert set(got["betas"]) == {(0.9, 0.999)}, name


def test_reference_runs_the_formulas(reference):
    for name in SCHEDULES:
        _assert_rates(reference[name], name)
        assert len(reference[name]["loss"]) == STEPS
    assert len({tuple(reference[n]["lrs"]) for n in SCHEDULES}) == len(SCHEDULES)  # six different schedules


def test_zero_trainer_at_one_rank_follows_each_schedule_and_resumes_it(reference, tmp_path):
    result = run_distributed(zero_rank, 1, str(tmp_path), list(SCHEDULES), timeout=600, env=ENV)[0]
    for name in SCHEDULES:
        _assert_rates(result[name], name)
        _assert_matches(result[name], reference[name], name)
    for name in RESUMED:  # steps 5-8 again from checkpoint-4: the same rates and training as without the stop
        resumed = result[f"{name} resumed"]
        _assert_rates(resumed, name, first=4)
        for key in ("loss", "grad_norm"):
            assert resumed[key] == pytest.approx(result[name][key], abs=1e-6), (name, key)
        _assert_matches(resumed, result[name], name, tol=1e-6)
    refused = result["refused"]
    assert len(refused) == 8 and result["accepted"] == 2, refused
    assert "scheduler.params.warmup_num_steps is 10 and HF fills it with TrainingArguments' warmup" in refused[0]
    assert "scheduler.params.warmup_max_lr is 0.001 and HF fills it with TrainingArguments.learning_rate=0.002" \
        in refused[1]
    assert "'Cosine', which is not a DeepSpeed scheduler" in refused[2]
    assert "partitioned by DeepSpeed's zero.Init: from_pretrained ran while" in refused[3]
    assert "optimizer is 'Lamb' and the Trainer builds TrainingArguments.optim='adamw_torch" in refused[4]
    assert "adam_w_mode false" in refused[5]
    assert "optimizer.params.lr is 0.0003 and TrainingArguments.learning_rate is 0.002" in refused[6]
    assert "optimizer.params.betas is [0.9, 0.95]" in refused[7]


def test_zero_trainer_at_two_ranks_follows_each_schedule_and_training_arguments_deepspeed_works(reference, tmp_path):
    result = run_distributed(zero_rank, 2, str(tmp_path), TWO_RANKS, timeout=600, env=ENV)
    for rank_result in result:
        assert [name for name in SCHEDULES if name in rank_result] == TWO_RANKS
        for name in TWO_RANKS:
            _assert_rates(rank_result[name], name)
    for name in TWO_RANKS:
        _assert_matches(result[0][name], reference[name], name)
    # TrainingArguments(deepspeed=...) trains exactly as ZeroTrainer(deepspeed=...): bit for bit, no DeepSpeed engine
    via_args = result[0]["arguments"]
    assert via_args["plugin"] is None and via_args["zero3"] is False
    assert via_args["loss"] == result[0]["WarmupLR"]["loss"] and via_args["lrs"] == result[0]["WarmupLR"]["lrs"]
    for key, value in result[0]["WarmupLR"]["params"].items():
        assert torch.equal(via_args["params"][key], value), key

