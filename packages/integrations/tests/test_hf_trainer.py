"""``ZeroTrainer``: the HuggingFace Trainer's own loop under zero, against the plain Trainer in one process.

A tiny GPT-2 (tied embeddings) built from a config, fp32, no dropout. The zero run uses 2
ranks with 2 sequences each per micro-batch; the reference one process with 4, so each
optimizer step sees the same 8 sequences (gradient accumulation 2, sequential sampling).
Clipping acts on every step (``max_grad_norm`` below every step's norm). Checked: the
logged losses and ``grad_norm`` (the global pre-clip norm), the final weights, resuming
from the ``save_steps`` checkpoint, and the exported directory loaded by
``from_pretrained`` (plain transformers) giving the same logits.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

from zero_core.base.errors import CheckpointError
from zero_core.testing import DistributedTestError, run_distributed

VOCAB, SEQ, SAMPLES = 96, 16, 32
STEPS, ACCUM, PER_RANK = 4, 2, 2
MAX_NORM = 0.5
TOL = 1e-5
# zero's 16-bit compute (16-bit copies of the weights) against the plain Trainer's autocast over fp32 weights
MIXED_TOL = {"bf16": 1e-3, "fp16": 2e-4}  # measured: 1.6e-4 and 4.1e-5
# the ranks build Trainers: the suite's fork server imports it once (tests/conftest.py)
SPAWN_PRELOAD = ("transformers.trainer",)
# Accelerate insists on these even though the ranks' process group is initialised already (it joins that group).
ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def dataset(samples: int = SAMPLES, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(output_dir: str, per_device: int, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=ACCUM,
                    max_steps=STEPS, learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=0,
                    max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                    use_cpu=True, seed=0, train_sampling_strategy="sequential", dataloader_num_workers=0,
                    disable_tqdm=True, eval_strategy="steps", eval_steps=2,
                    per_device_eval_batch_size=2 * per_device)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _history(trainer) -> dict[str, list[float]]:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    return {"loss": [entry["loss"] for entry in logs], "grad_norm": [entry["grad_norm"] for entry in logs],
            "eval_loss": evals}


def reference_rank(output_dir: str) -> dict:
    """The plain Trainer in one process (a 1-rank group, so nothing of the pytest process leaks in)."""
    from transformers import Trainer

    model = build_model()
    trainer = Trainer(model=model, args=arguments(output_dir, PER_RANK * 2, save_strategy="no"), train_dataset=dataset(),
                      eval_dataset=dataset(8, seed=8))
    trainer.train()
    return {"history": _history(trainer), "params": {n: p.detach().clone() for n, p in model.state_dict().items()}}


def zero_rank(output_dir: str, export_dir: str, resume: str | bool | None, stage: int,
              async_checkpoints: bool = False, die_at: tuple[int, str] | None = None, limit: int | None = None) -> dict:
    """``die_at=(step, method)``: rank 1 is killed (SIGKILL) as the Trainer's save of ``checkpoint-<step>`` calls
    ``method``: ``"_save_optimizer_and_scheduler"`` (the model files written, zero's not begun) or
    ``"_save_rng_state"`` (zero's write begun, in the background with ``async_checkpoints``). ``limit``:
    ``save_total_limit``."""
    from zero_core import ChunkPolicy, ZeroConfig
    from zero_integrations.hf import ZeroTrainer

    class DyingTrainer(ZeroTrainer):
        def _maybe_die(self, method: str) -> None:
            if die_at is not None and (self.state.global_step, method) == die_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if die_at is not None and self.state.global_step == die_at[0]:
                self._wait_pending_save()  # the previous checkpoint complete on both ranks, as a save begins
            self._maybe_die("_save_optimizer_and_scheduler")
            super()._save_optimizer_and_scheduler(output_dir)

        def _save_rng_state(self, output_dir: str) -> None:
            self._maybe_die("_save_rng_state")
            super()._save_rng_state(output_dir)

    model = build_model()
    trainer = DyingTrainer(model=model, args=arguments(output_dir, PER_RANK, save_total_limit=limit),
                           train_dataset=dataset(),
                          eval_dataset=dataset(8, seed=8),
                          zero_config=ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=8192)),
                          max_shard_size=40_000, async_checkpoints=async_checkpoints)
    trainer.train(resume_from_checkpoint=resume)
    identity = {"same_object": trainer.model is model, "config": type(trainer.model.config).__name__}
    if export_dir:
        trainer.save_model(export_dir)  # every rank: the export is collective
    params = trainer.model.full_state_dict()  # rank 0 holds it
    return {"history": _history(trainer), "params": params, "identity": identity, "rank": dist.get_rank()}


@functools.cache
def reference(tmp: str) -> dict:
    return run_distributed(reference_rank, 1, tmp, timeout=240, env=ENV)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference, one uninterrupted zero run with its checkpoints and export, shared by the tests below."""
    root = tmp_path_factory.mktemp("hf_trainer")
    ref = reference(str(root / "reference"))
    out, export = root / "zero", root / "export"
    results = run_distributed(zero_rank, 2, str(out), str(export), None, 3, timeout=300, env=ENV)
    return {"root": root, "reference": ref, "zero": results, "out": out, "export": export}


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        diff = (got[key].float() - want[key].float()).abs().max().item()
        assert diff <= tol, f"{key}: max abs diff {diff} > {tol}"


def test_trainer_matches_one_process_with_accumulation_and_clipping(runs):
    ref, zero = runs["reference"], runs["zero"]
    assert len(ref["history"]["loss"]) == STEPS and len(ref["history"]["eval_loss"]) == STEPS // 2
    assert all(norm > MAX_NORM for norm in ref["history"]["grad_norm"]), ref["history"]  # clipping acts
    for rank_result in zero:
        assert rank_result["identity"] == {"same_object": True, "config": "GPT2Config"}
        # the logged values are the run's: the loss averaged over ranks, the global pre-clip norm
        # evaluation between steps (eval_steps=2) runs the sharded model under no_grad on every rank
        for name in ("loss", "grad_norm", "eval_loss"):
            got, want = rank_result["history"][name], ref["history"][name]
            assert got == pytest.approx(want, abs=TOL, rel=TOL), (name, got, want)
    _assert_close(zero[0]["params"], ref["params"], TOL)


def test_every_rank_writes_its_shards_and_resume_equals_the_uninterrupted_run(runs):
    checkpoint = runs["out"] / "checkpoint-2"
    names = set(os.listdir(checkpoint))
    assert {"zero", "config.json", "trainer_state.json", "scheduler.pt"} <= names, names
    assert not {"optimizer.pt", "pytorch_model.bin"} & names  # nothing gathered onto rank 0
    shard_files = os.listdir(checkpoint / "zero")
    assert {name.split(".")[1] for name in shard_files if name.endswith(".safetensors")} == {
        "rank00000-of-00002", "rank00001-of-00002"}, shard_files  # one shard file per rank, each written by its rank

    resumed = run_distributed(zero_rank, 2, str(runs["out"]), "", str(checkpoint), 3, timeout=300, env=ENV)
    uninterrupted = runs["zero"][0]
    # the resumed run's history holds steps 1-2 from the checkpoint and steps 3-4 it trained itself
    for name in ("loss", "grad_norm", "eval_loss"):
        assert resumed[0]["history"][name] == pytest.approx(uninterrupted["history"][name], abs=1e-6), name
    _assert_close(resumed[0]["params"], uninterrupted["params"], 1e-6)


def _shard_files(checkpoint) -> list[dict[str, torch.Tensor]]:
    """Each rank's shard file, tensor by tensor (the files differ only by their save id)."""
    import json

    from safetensors.torch import load_file

    metadata = json.loads((checkpoint / "zero" / "zero_checkpoint.json").read_text())
    return [load_file(checkpoint / "zero" / f["name"]) for f in metadata["files"]]


def test_background_checkpoints_are_the_same_and_a_torn_one_is_skipped(runs):
    """async_checkpoints=True: the same training and the same shard files, tensor for tensor; a
    checkpoint whose background write never completed (its metadata missing) is skipped by
    resume_from_checkpoint=True, which resumes from the last complete one."""
    out = runs["root"] / "zero-async"
    background = run_distributed(zero_rank, 2, str(out), "", None, 3, True, timeout=300, env=ENV)
    for name in ("loss", "grad_norm", "eval_loss"):
        assert background[0]["history"][name] == runs["zero"][0]["history"][name], name
    # checkpoint-2 (checkpoint-4 of the shared run is rewritten by the resume test)
    for got, want in zip(_shard_files(out / "checkpoint-2"), _shard_files(runs["out"] / "checkpoint-2"), strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    (out / "checkpoint-4" / "zero" / "zero_checkpoint.json").unlink()  # as if the run stopped during the write
    resumed = run_distributed(zero_rank, 2, str(out), "", True, 3, True, timeout=300, env=ENV)
    uninterrupted = runs["zero"][0]
    for name in ("loss", "grad_norm", "eval_loss"):  # steps 3-4 trained again from checkpoint-2
        assert resumed[0]["history"][name] == pytest.approx(uninterrupted["history"][name], abs=1e-6), name
    _assert_close(resumed[0]["params"], uninterrupted["params"], 1e-6)


def test_the_last_complete_checkpoint_is_found(tmp_path):
    from zero_integrations.hf import last_complete_checkpoint

    assert last_complete_checkpoint(str(tmp_path / "absent")) is None
    for name, files in {"checkpoint-2": ["zero/zero_checkpoint.json"], "checkpoint-3": ["trainer_state.json"],
                        "checkpoint-10": ["zero/x.safetensors", "trainer_state.json"], "checkpoint-11": ["config.json"],
                        "runs": []}.items():
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text("{}")
    # 10's zero save is torn, 11 stopped before zero/ was begun; 3 is a plain Trainer's checkpoint (no zero/)
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")


# The files of a ZeroTrainer save of checkpoint-N on 2 ranks, by what writes them (see [Note: a complete Trainer
# checkpoint under zero]), and what each must follow: the order of each rank's own calls, and zero's collectives
# (zero/ is made once both ranks arrived; its metadata is written once both shard files are). With
# async_checkpoints the shard files and the metadata are written in the background: the metadata may land after any of
# the files that follow it on rank 0, and rank 1's RNG file may come before its shard file. A synchronous save is one
# of these orders too, so every prefix of every real order is a state below.
_SAVE_PARTS = {  # part: the parts it comes after
    "model": (), "training_args": ("model",), "zero_begun": ("training_args",), "shard0": ("zero_begun",),
    "shard1": ("zero_begun",), "metadata": ("shard0", "shard1"), "scheduler": ("zero_begun",),
    "rng0": ("scheduler",), "rng1": ("zero_begun",), "trainer_state": ("rng0",),
}


def _part_of(name: str) -> str:
    if name.startswith("zero/"):
        return "metadata" if name.endswith("zero_checkpoint.json") else "shard0" if ".rank00000-" in name else "shard1"
    return {"training_args.bin": "training_args", "scheduler.pt": "scheduler", "rng_state_0.pth": "rng0",
            "rng_state_1.pth": "rng1", "trainer_state.json": "trainer_state"}.get(name, "model")


def _reachable_states() -> list[frozenset[str]]:
    """Every set of parts some interleaving has written when a rank stops: the sets closed under _SAVE_PARTS."""
    parts = list(_SAVE_PARTS)
    return [frozenset(chosen) for n in range(len(parts) + 1) for chosen in itertools.combinations(parts, n)
            if all(set(_SAVE_PARTS[part]) <= set(chosen) for part in chosen)]


def test_a_checkpoint_is_complete_only_when_every_file_a_resume_reads_is_whole(runs, tmp_path):
    """Every state a rank stopped anywhere in the Trainer's save (any interleaving of the ranks, synchronous or
    asynchronous zero write) can leave: only the whole save is resumed from; every other state is skipped for the
    previous checkpoint by resume_from_checkpoint=True, and refused by name as an explicit path, before anything is
    loaded. A file cut short by the kill (the Trainer's JSON and torch.save are not atomic) counts as missing."""
    from zero_integrations.hf import ZeroTrainer, checkpoint_problems, last_complete_checkpoint

    source = runs["out"] / "checkpoint-2"  # a real save of the shared run (2 ranks), left as it was written
    files = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    parts = {_part_of(name) for name in files}
    assert parts == set(_SAVE_PARTS) - {"zero_begun"}, files  # the real save wrote every part, and nothing else
    out = tmp_path / "out"
    shutil.copytree(source, out / "checkpoint-2")
    states = _reachable_states()
    assert len(states) > 40
    trainer = ZeroTrainer(model=build_model(), args=arguments(str(out), PER_RANK, eval_strategy="no"))
    for state in states:
        torn = out / "checkpoint-4"
        shutil.rmtree(torn, ignore_errors=True)
        torn.mkdir()
        if "zero_begun" in state:
            (torn / "zero").mkdir()
        for name in files:
            if _part_of(name) in state:
                os.link(source / name, torn / name)
        complete = state == frozenset(_SAVE_PARTS)
        want = torn if complete else out / "checkpoint-2"
        assert last_complete_checkpoint(str(out)) == str(want), sorted(state)
        problems = checkpoint_problems(str(torn))
        assert bool(problems) != complete, (sorted(state), problems)
        if not complete:
            with pytest.raises(CheckpointError, match="not a complete checkpoint") as refused:
                trainer.train(resume_from_checkpoint=str(torn))
            missing = set(_SAVE_PARTS) - state
            if "trainer_state" in missing:
                assert "no trainer_state.json" in str(refused.value)
            if "metadata" in missing and "zero_begun" in state:
                assert "zero_checkpoint.json" in str(refused.value)
            if "zero_begun" not in state:
                assert "no zero/" in str(refused.value)
    # each non-atomic file cut short, the rest whole: skipped, naming the file
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_1.pth"):
        shutil.rmtree(torn)
        shutil.copytree(source, torn)
        data = (torn / name).read_bytes()
        (torn / name).write_bytes(data[: len(data) // 2])
        assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-2"), name
        assert any(name in problem and "cut short" in problem for problem in checkpoint_problems(str(torn))), name
    # nothing complete: resume_from_checkpoint=True names each torn checkpoint and what it lacks
    shutil.rmtree(out / "checkpoint-2")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*checkpoint-4: rng_state_1.pth is cut short"):
        trainer.train(resume_from_checkpoint=True)


def test_a_rank_killed_before_zero_wrote_resumes_from_the_previous_checkpoint(runs):
    """The issue's case, for real: rank 1 dies in the save of checkpoint-4 after the Trainer wrote the model files
    there and before zero/ exists; resume_from_checkpoint=True resumes from checkpoint-2 and trains as the
    uninterrupted run did."""
    from zero_integrations.hf import checkpoint_problems

    out = runs["root"] / "zero-killed"
    with pytest.raises(DistributedTestError, match=f"rank 1 exited with code {-signal.SIGKILL}"):
        run_distributed(zero_rank, 2, str(out), "", None, 3, True, (4, "_save_optimizer_and_scheduler"),
                        timeout=300, env=ENV)
    torn = out / "checkpoint-4"
    assert (torn / "config.json").is_file() and not (torn / "trainer_state.json").exists()
    assert checkpoint_problems(str(torn))[0].startswith("no zero/")
    resumed = run_distributed(zero_rank, 2, str(out), "", True, 3, True, timeout=300, env=ENV)
    uninterrupted = runs["zero"][0]
    for name in ("loss", "grad_norm", "eval_loss"):  # steps 3-4 trained again from checkpoint-2
        assert resumed[0]["history"][name] == pytest.approx(uninterrupted["history"][name], abs=1e-6), name
    _assert_close(resumed[0]["params"], uninterrupted["params"], 1e-6)
    assert not checkpoint_problems(str(torn))  # the resumed run's own save of checkpoint-4 is complete


def test_a_rank_killed_during_the_background_write_under_save_total_limit_1_leaves_the_previous_checkpoint(runs):
    """save_total_limit=1 with async_checkpoints: the Trainer rotates while checkpoint-4's zero/ is still being
    written, so it keeps one checkpoint more (checkpoint-2, the one a resume needs) until the write completed. Rank 1
    dies once its background write began (rank 0 goes on to write trainer_state.json and rotate); the resume takes
    checkpoint-2, and once its own checkpoint-4 completed, only that one is left."""
    from zero_integrations.hf import checkpoint_problems

    out = runs["root"] / "zero-killed-limit"
    with pytest.raises(DistributedTestError, match=f"rank 1 exited with code {-signal.SIGKILL}"):
        run_distributed(zero_rank, 2, str(out), "", None, 3, True, (4, "_save_rng_state"), 1, timeout=300, env=ENV)
    torn = out / "checkpoint-4"
    assert (torn / "trainer_state.json").is_file()  # rank 0 finished the Trainer's save, rotation included
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    problems = checkpoint_problems(str(torn))
    assert problems[0].startswith("zero/: ") and "incomplete checkpoint" in problems[0], problems
    assert not (torn / "rng_state_1.pth").exists()
    resumed = run_distributed(zero_rank, 2, str(out), "", True, 3, True, None, 1, timeout=300, env=ENV)
    uninterrupted = runs["zero"][0]
    for name in ("loss", "grad_norm", "eval_loss"):
        assert resumed[0]["history"][name] == pytest.approx(uninterrupted["history"][name], abs=1e-6), name
    _assert_close(resumed[0]["params"], uninterrupted["params"], 1e-6)
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and not checkpoint_problems(str(torn))


def test_exported_directory_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM

    export = runs["export"]
    names = set(os.listdir(export))
    assert {"config.json", "model.safetensors.index.json"} <= names, names
    assert sum(name.endswith(".safetensors") for name in names) >= 2, names  # max_shard_size split it

    loaded = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    trained = build_model().eval()
    trained.load_state_dict(runs["zero"][0]["params"])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-6, diff


def compiled_rank(output_dir: str) -> dict:
    """TrainingArguments(torch_compile=True): ZeroTrainer compiles each GPT2Block (aot_eager: the same kernels)."""
    from zero_core import ChunkPolicy, ZeroConfig
    from zero_integrations.hf import ZeroTrainer

    model = build_model()
    args = arguments(output_dir, PER_RANK, save_strategy="no", torch_compile=True, torch_compile_backend="aot_eager",
                     eval_strategy="steps")
    trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=8),
                          zero_config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=8192)))
    trainer.train()
    compiled = sorted({type(m).__name__ for m in model.modules() if getattr(m, "_compiled_call_impl", None)})
    return {"history": _history(trainer), "params": trainer.model.full_state_dict(), "compiled": compiled}


def test_torch_compile_argument_compiles_each_block_to_parity(runs, tmp_path):
    results = run_distributed(compiled_rank, 2, str(tmp_path), timeout=300, env=ENV)
    ref = runs["reference"]
    assert results[0]["compiled"] == ["GPT2Block"]
    for name in ("loss", "grad_norm", "eval_loss"):
        assert results[0]["history"][name] == pytest.approx(ref["history"][name], abs=TOL, rel=TOL), name
    _assert_close(results[0]["params"], ref["params"], TOL)


def precision_rank(output_dir: str) -> dict:
    """zero's mixed precision under the Trainer, set in zero_config and, the same, by TrainingArguments(bf16/fp16=True)
    (see [Note: HF arguments under zero]); fp16's loss must be scaled by zero's scaler through the Trainer's backward."""
    from zero_core import ChunkPolicy, LossScale, Precision, ZeroConfig
    from zero_integrations.hf import ZeroTrainer

    out = {}
    runs = [("bf16", Precision(compute="bf16"), {}), ("fp16", Precision(compute="fp16", loss_scale=LossScale()), {}),
            ("bf16 args", None, {"bf16": True}), ("fp16 args", None, {"fp16": True})]
    for name, precision, overrides in runs:
        config = ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=8192))
        args = arguments(output_dir, PER_RANK, save_strategy="no", **overrides)
        trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=8),
                              zero_config=config if precision is None else config.replace(precision=precision))
        trainer.train()
        scaler = trainer.model.loss_scaler
        out[name] = {"history": _history(trainer), "scale": None if scaler is None else scaler.scale,
                     "autocast": trainer.accelerator.mixed_precision, "args": (args.bf16, args.fp16)}
        trainer.model.close()
    return out


def mixed_reference_rank(output_dir: str) -> dict:
    """The plain Trainer with TrainingArguments(bf16=True), then fp16=True, in one process: Accelerate's autocast over
    fp32 weights (and its GradScaler for fp16)."""
    from transformers import Trainer

    out = {}
    for flag in ("bf16", "fp16"):
        args = arguments(output_dir, PER_RANK * 2, save_strategy="no", **{flag: True})
        trainer = Trainer(model=build_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=8))
        trainer.train()
        out[flag] = _history(trainer)
    return out


def test_zero_mixed_precision_trains_under_the_trainer(runs, tmp_path):
    result = run_distributed(precision_rank, 2, str(tmp_path), timeout=300, env=ENV)[0]
    ref = runs["reference"]["history"]
    assert result["bf16"]["scale"] is None and result["fp16"]["scale"] == 2.0 ** 16
    for name in ("bf16", "fp16"):
        # the TrainingArguments flag is zero's precision, bit for bit, with Accelerate's autocast off; the user's
        # arguments object is left as it was
        assert result[f"{name} args"]["history"] == result[name]["history"], name
        assert result[f"{name} args"]["autocast"] == "no" and result[f"{name} args"]["args"] == \
            (name == "bf16", name == "fp16")
        for key in ("loss", "eval_loss"):
            assert result[name]["history"][key] == pytest.approx(ref[key], abs=5e-3), (name, key)
    # against the plain Trainer's bf16 and fp16 (autocast of fp32 weights, not zero's 16-bit copies): within the
    # 16-bit rounding of two casting rules
    plain = run_distributed(mixed_reference_rank, 1, str(tmp_path / "plain"), timeout=240, env=ENV)[0]
    for flag in ("bf16", "fp16"):
        for key in ("loss", "eval_loss"):
            assert result[f"{flag} args"]["history"][key] == pytest.approx(plain[flag][key], abs=MIXED_TOL[flag]), \
                (flag, key)


def arguments_rank(output_dir: str) -> dict:
    """gradient_checkpointing=True and a DeepSpeed dict with "auto" values, as HF users pass them."""
    from zero_integrations.hf import ZeroTrainer

    out = {}
    args = arguments(output_dir, PER_RANK, save_strategy="no", gradient_checkpointing=True)
    trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=8))
    trainer.train()
    out["checkpointing"] = {"history": _history(trainer), "params": trainer.model.full_state_dict(),
                            "kwargs": args.gradient_checkpointing_kwargs}
    trainer.model.close()
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "bf16": {"enabled": "auto"},
          "fp16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    trainer = ZeroTrainer(model=build_model(), args=arguments(output_dir, PER_RANK, save_strategy="no"),
                          train_dataset=dataset(), eval_dataset=dataset(8, seed=8), deepspeed=ds)
    trainer.train()
    out["deepspeed"] = {"history": _history(trainer), "params": trainer.model.full_state_dict(),
                        "stage": trainer.zero_config.stage, "bucket_mb": trainer.zero_config.reduce_bucket_mb}
    trainer.model.close()
    return out


def test_gradient_checkpointing_and_a_deepspeed_config_as_hf_users_pass_them(runs, tmp_path):
    result = run_distributed(arguments_rank, 2, str(tmp_path), timeout=300, env=ENV)[0]
    ref = runs["reference"]
    assert result["checkpointing"]["kwargs"] is None  # the user's arguments: untouched
    assert result["deepspeed"]["stage"] == 2
    assert result["deepspeed"]["bucket_mb"] == pytest.approx(32 * 32 * 4 / 2**20)  # "auto": hidden_size**2 elements
    for name in ("checkpointing", "deepspeed"):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert result[name]["history"][key] == pytest.approx(ref["history"][key], abs=TOL, rel=TOL), (name, key)
        _assert_close(result[name]["params"], ref["params"], TOL)


def best_rank(output_dir: str) -> dict:
    """load_best_model_at_end: after training, the model holds the best checkpoint's parameters (from its zero/)."""
    from zero_core import ChunkPolicy, ZeroConfig
    from zero_integrations.hf import ZeroTrainer

    args = arguments(output_dir, PER_RANK, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer = ZeroTrainer(model=build_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=8),
                          zero_config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=8192)))
    trainer.train()
    return {"best": trainer.state.best_model_checkpoint, "history": _history(trainer),
            "params": trainer.model.full_state_dict()}


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_distributed(best_rank, 2, str(tmp_path), timeout=300, env=ENV)[0]
    evals = result["history"]["eval_loss"]
    best_step = 2 * (evals.index(min(evals)) + 1)  # evaluated (and saved) every 2 steps
    assert result["best"] == str(tmp_path / f"checkpoint-{best_step}")
    assert best_step != STEPS, evals  # the data makes an earlier checkpoint the best: loading it changes the model
    saved = AutoModelForCausalLM.from_pretrained(result["best"]).state_dict()
    for key, value in result["params"].items():
        assert torch.equal(value, saved[key]), key


def refusals_rank(output_dir: str) -> list[str]:
    from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig
    from zero_integrations.hf import ZeroTrainer

    messages = []
    attempts = [
        dict(args=arguments(output_dir, PER_RANK, eval_strategy="no", bf16=True),
             zero_config=ZeroConfig(precision=Precision(compute="fp16", loss_scale=LossScale()), chunk=ChunkPolicy())),
        dict(args=arguments(output_dir, PER_RANK, eval_strategy="no"), deepspeed={"zero_optimization": {"stage": 2}},
             zero_config=ZeroConfig()),
        dict(args=arguments(output_dir, PER_RANK, eval_strategy="no", max_grad_norm=1.0),
             deepspeed={"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}),
        dict(args=arguments(output_dir, PER_RANK, eval_strategy="no", gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": True})),
    ]
    for attempt in attempts:
        try:
            ZeroTrainer(model=build_model(), train_dataset=dataset(), **attempt)
        except ConfigError as exc:
            messages.append(str(exc))
    trainer = ZeroTrainer(model=build_model(), args=arguments(output_dir, PER_RANK, eval_strategy="no"), train_dataset=dataset())
    try:
        trainer._save_optimizer_and_scheduler(output_dir)  # what a checkpoint before train() would do
    except ConfigError as exc:
        messages.append(str(exc))
    try:
        ZeroTrainer(model=build_model(), args=arguments(output_dir, PER_RANK, eval_strategy="no"), zero_config={"stage": 3})
    except ConfigError as exc:
        messages.append(str(exc))
    return messages


def test_conflicting_settings_are_refused_with_the_fix(tmp_path):
    messages = run_distributed(refusals_rank, 1, str(tmp_path), timeout=120, env=ENV)[0]
    assert len(messages) == 6, messages
    assert "TrainingArguments(bf16=True) but the zero config computes in fp16" in messages[0]
    assert "both zero_config and a DeepSpeed config" in messages[1]
    assert "gradient_clipping is 0.5 and TrainingArguments.max_grad_norm is 1.0" in messages[2]
    assert "use_reentrant" in messages[3]
    assert "call train() first" in messages[4]
    assert "zero_core.ZeroConfig" in messages[5]
